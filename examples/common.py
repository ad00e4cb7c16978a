"""What the journey scripts share: the model to run (the tiny CPU Llama, or yours on a
GPU), labelled prompts, HTTP requests, and starting and stopping `actbus` commands.

Each script is meant to be read: it runs the commands a user would type, in order, and
prints what it made. This module only keeps the plumbing out of their way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOPICS = [
    "the residual stream",
    "sparse autoencoders",
    "linear probes",
    "continuous batching",
    "chunked prefill",
    "prefix caching",
    "ZeroMQ sockets",
    "Arrow files",
    "quick brown foxes",
    "lazy dogs",
    "throughput and latency",
]


@dataclass(frozen=True)
class Model:
    """What to serve and how: the tiny random-weight Llama on CPU, or a real model on a GPU."""

    path: str
    layers: tuple[int, ...]
    gpu: bool
    dtype: str
    gpu_memory_utilization: float
    max_model_len: int
    load_format: str | None

    def serve_flags(self) -> list[str]:
        """vLLM's flags for ``actbus serve`` (after the model and capture flags)."""
        flags = ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
        flags += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.load_format:
            flags += ["--load-format", self.load_format]
        return flags

    def llm_kwargs(self) -> dict[str, Any]:
        """The same settings for an offline ``vllm.LLM``."""
        kw: dict[str, Any] = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": 0,
        }
        if self.load_format:
            kw["load_format"] = self.load_format
        return kw

    def trainer_flags(self) -> list[str]:
        """Where the trainers run: the CPU here, the GPU beside the engine with --gpu."""
        if self.gpu:
            return ["--accelerator", "gpu", "--precision", "bf16-mixed"]
        return ["--accelerator", "cpu"]


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (default: the tiny random-weight Llama, on CPU)")
    g.add_argument("--gpu", action="store_true", help="run on a GPU: bf16, trainers on the GPU")
    g.add_argument("--model", default=None, help="model path or name (default: the tiny Llama)")
    g.add_argument("--layers", default=None, help="layers to tap: 1,3 (tiny) / 8,16 (--gpu)")
    g.add_argument("--max-model-len", type=int, default=None, help="512 (tiny) / 4096 (--gpu)")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of memory: 0.3 (CPU: its KV cache) / 0.6 (--gpu: room for trainers)",
    )
    g.add_argument(
        "--dummy-weights",
        action="store_true",
        help="random weights of the model's shape (vLLM's --load-format dummy): no download",
    )


def model_of(args: argparse.Namespace) -> Model:
    if args.model is None:
        if args.gpu:
            raise SystemExit("--gpu: give --model PATH_OR_NAME (and --layers)")
        from actbus.tiny_models import build_tiny_model

        path = str(build_tiny_model("llama"))
    else:
        path = args.model
    layers = args.layers or ("8,16" if args.gpu else "1,3")
    return Model(
        path=path,
        layers=tuple(int(x) for x in layers.split(",")),
        gpu=args.gpu,
        dtype="bfloat16" if args.gpu else "float32",
        gpu_memory_utilization=args.gpu_memory_utilization or (0.6 if args.gpu else 0.3),
        max_model_len=args.max_model_len or (4096 if args.gpu else 512),
        load_format="dummy" if args.dummy_weights else None,
    )


def prompts(n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` prompts, each with request tags: ``label`` (0/1, for the probe) and ``topic``."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Note {i} on {topic}: " + ("a short one. " if i % 2 else "a longer one, " * 3)
        out.append((text, {"label": i % 2, "topic": topic}))
    return out


def complete(url: str, model: str, prompt: str, tags: dict, max_tokens: int) -> dict[str, Any]:
    """One completion over HTTP, its tags in ``vllm_xargs`` (the HTTP form of a selection)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "vllm_xargs": {"actbus": json.dumps({"tags": tags})},
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def send_all(url: str, model: str, items: list[tuple[str, dict]], max_tokens: int) -> int:
    """Send every prompt, 4 at a time; the tokens fed to the model (rows per tapped layer)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda it: complete(url, model, it[0], it[1], max_tokens), items))
    return sum(o["usage"]["prompt_tokens"] + o["usage"]["completion_tokens"] - 1 for o in outs)


def free_port() -> int:
    """A loopback TCP port free right now (for a server the example starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{proc.args[3:5]} exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url} did not answer within {timeout:.0f}s")


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def actbus(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``actbus ARGS...`` as its own process, its output in ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "actbus.cli", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


def finish(proc: subprocess.Popen, timeout: float, sig: int | None = None) -> int:
    """Wait for ``proc`` (after ``sig``, if given; Ctrl-C is SIGINT); kill it past ``timeout``."""
    if sig is not None and proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return -int(signal.SIGKILL)


def subscribers(address: str) -> dict[str, Any]:
    """The publisher's subscribers, by name (what ``actbus stats`` shows)."""
    from actbus.bus import Subscriber, Subscription
    from actbus.bus.statsview import request

    with Subscriber(address, Subscription(layers=(), name="journey-check")) as sub:
        sub.wait_welcome(30)
        return request(sub, 10)["subscribers"]


def wait_subscribed(address: str, names: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not names <= set(subscribers(address)):
        if time.monotonic() > deadline:
            raise SystemExit(f"not all of {sorted(names)} subscribed within {timeout:.0f}s")
        time.sleep(1.0)


def has_wandb_credentials() -> bool:
    from consumers.wandb_offline import has_credentials

    return has_credentials()


def step(n: int, total: int, text: str) -> None:
    print(f"[{n}/{total}] {text}", flush=True)
