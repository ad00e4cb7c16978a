"""The shared CPU engines of the test suite: their settings, and a pool that keeps one alive.

Engine start costs about a minute on CPU, so engines are shared by the whole session.
The pool holds at most one at a time (two would need twice the memory), and the root
conftest orders the tests so that each architecture's engine starts once: every test
that needs the Llama engine, whether through ``engine[llama]`` or ``sched_engine``, runs
in one block.

The Llama engine is the hard one: prefix caching on, a KV cache far too small for its
batches (so the scheduler preempts and recomputes), and small prefill chunks; the tests
of selections, aborts, n>1, faults and monitors run on it (it also evaluates one
monitor of each kind: ``tests/support/monitors.py``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
SCHED_ARCH = "llama"
INDUCTOR_ARCHS = frozenset({SCHED_ARCH})
"""The engines compiled by Inductor, each in its own engine-core process as a server
runs it. The others trace with Dynamo (taps, steering and monitors in the graph as vLLM
splits it), run that graph without Inductor's code generation, and run in the test
process (``IN_PROCESS``): their tests are about where each architecture's taps sit, not
about Inductor's kernels or the engine process, which the Llama engine covers. A start
takes seconds, not half a minute."""
DYNAMO_ONLY = {"VLLM_CPU_CI_ENV": "1"}
"""vLLM CPU's own CI switch (``vllm/platforms/cpu.py``): compile backend ``eager``, no
warm-up run. Read by the front end when the config is built and by the workers it
starts, so setting it around one engine's start is enough. GPU platforms ignore it. Not
for pipeline parallelism: without the warm-up run vLLM's later stages never allocate
their intermediate tensors and the first step fails (vllm-cpu 0.32)."""
IN_PROCESS = {**DYNAMO_ONLY, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""A tiny engine of a test's own, in the test process and Dynamo-only: a start of about
2 s, not 15-60 (families, MoE, user hooks). Its KV space is set outright (GiB): in the
test process, that process's own memory would count against ``gpu_memory_utilization``'s
share, and late in the suite exceed it."""
# 0: the first layer gets residual=None (pre_attn is the embeddings);
# 3: the last layer of the tiny models (post_block before the final norm).
CAPTURE_LAYERS = [0, 3]
HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block"]
STEER_HOOKS = ["pre_attn", "post_attn", "post_block"]
MAX_BATCHED_TOKENS = 64  # small, so longer prompts are split by chunked prefill
SCHED_BLOCKS = 17  # x 32 tokens: one max_model_len request (+ the null block), no more
STEER_OPS = ("replace", "ablate", "clamp")
"""The Llama engine's operations beyond ``add`` (``actbus.steer.ops``)."""
LIVE = ["live_dir", "live_sae"]
"""The Llama engine's live steering vectors (``actbus.steer.live``), zeros at start."""


@dataclass
class Engine:
    llm: object
    address: str
    model_path: Path
    arch: str
    monitor: dict | None = None
    """The engine's ``actbus.monitor`` entry (the Llama engine's), or None."""
    control: dict | None = None
    """The Llama engine's control endpoint: ``address`` and the CURVE files a pushing
    client uses (``server_key``, ``client_secret_key``), or None."""


def start_engine(arch: str, model_path: Path, sock_dir: Path) -> Engine:
    """One offline ``LLM`` with actbus publishing every hook of ``CAPTURE_LAYERS``."""
    address = f"ipc://{sock_dir}/bus.sock"
    t0 = time.monotonic()
    sched = arch == SCHED_ARCH
    monitor: dict = {}
    control = None
    if sched:  # monitors of every kind at every hook point (tests/monitor)
        from tests.support.monitors import build_monitor_sources

        hidden = json.loads((model_path / "config.json").read_text())["hidden_size"]
        monitor = {"monitor": build_monitor_sources(model_path, sock_dir / "monitors", hidden)}
        control = _control_endpoint(sock_dir)
        monitor["control"] = {k: control[k] for k in ("address", *SERVER_KEYS)}
    with scoped_env({} if arch in INDUCTOR_ARCHS else IN_PROCESS):
        llm = _llm(arch, model_path, address, monitor)
    print(f"\n[engine {arch}] started in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return Engine(
        llm=llm,
        address=address,
        model_path=model_path,
        arch=arch,
        monitor=monitor.get("monitor"),
        control=control,
    )


@contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for what starts inside (an engine's processes inherit
    them), then put the old values back, so later engines start as they would have."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _llm(arch: str, model_path: Path, address: str, monitor: dict):
    from vllm import LLM

    sched = arch == SCHED_ARCH
    return LLM(
        str(model_path),
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=16,
        enable_prefix_caching=True,
        block_size=32 if sched else None,
        num_gpu_blocks_override=SCHED_BLOCKS if sched else 64,
        disable_log_stats=not sched,  # the Llama engine counts preemptions
        seed=0,
        additional_config={
            "actbus": {
                "publish": address,
                "layers": CAPTURE_LAYERS,
                "hooks": HOOKS,
                # Small, so a subscriber that blocks visibly holds generation back.
                "queue_mb": 1,
                "heartbeat_s": 0.25,
                # Long, so tests see death detected by the socket, not by silence.
                "subscriber_timeout_s": 30,
                # Every layer and point steerable: the capture tests then also show that
                # the steering ops cost unsteered requests nothing (tests/steer). The
                # Llama engine also has live vectors that pushes replace
                # (tests/steer/test_steer_live.py, tests/trainers/test_engine.py).
                # The Llama engine also replaces, ablates and clamps (tests/steer/
                # test_steer_ops_engine.py): every test on it runs with those terms in
                # the graph, so they are shown to leave the other requests alone.
                "steer": {
                    "hooks": list(STEER_HOOKS),
                    **({"live": LIVE, "ops": list(STEER_OPS)} if sched else {}),
                },
                **monitor,
            }
        },
    )


SERVER_KEYS = ("server_secret_key", "authorized_keys")


def _control_endpoint(sock_dir: Path) -> dict:
    """A CURVE control endpoint on a loopback port (tests/monitor/test_monitor_push.py),
    its keys made with ``actbus keys``' code: what the server binds and what a client
    holds."""
    from actbus.bus.security import generate_keys
    from tests.support.procs import free_port

    keys = generate_keys(sock_dir / "control-keys", client="trainer")
    port = free_port()
    return {
        "address": f"tcp://127.0.0.1:{port}",
        "server_secret_key": str(keys.server_secret),
        "authorized_keys": str(keys.authorized_keys),
        "server_key": str(keys.server_public),
        "client_secret_key": str(keys.client_secret),
    }


def start_in_process(model: Path | str, actbus: dict, **engine: Any) -> Any:
    """A tiny engine of a test's own (``IN_PROCESS``): float32, seed 0, 0.3 of memory
    unless ``engine`` (vLLM's engine arguments) says otherwise, capturing as ``actbus``
    (its ``additional_config`` entry) says. Stop it with ``stop_llm``; what earlier
    ones held, once nothing refers to them, is collected before this one starts."""
    from vllm import LLM

    gc.collect()
    kwargs = {"dtype": "float32", "seed": 0, "gpu_memory_utilization": 0.3, **engine}
    with scoped_env(IN_PROCESS):
        return LLM(str(model), additional_config={"actbus": actbus}, **kwargs)


def stop_llm(llm: Any) -> None:
    """Shut an engine down: its publisher ends its stream, its workers stop."""
    llm.llm_engine.engine_core.shutdown()


def stop_engine(engine: Engine) -> None:
    stop_llm(engine.llm)
    engine.llm = None
    gc.collect()


class EnginePool:
    """Hands out the session's engines, keeping at most one alive."""

    def __init__(self, models: dict[str, Path], sock_root: Path) -> None:
        self._models = models
        self._sock_root = sock_root
        self._live: Engine | None = None
        self.starts: list[str] = []  # architectures in the order their engines started

    def get(self, arch: str) -> Engine:
        if self._live is not None and self._live.arch == arch:
            return self._live
        self.close()
        sock_dir = self._sock_root / f"bus-{arch}-{len(self.starts)}"
        sock_dir.mkdir(parents=True)
        self._live = start_engine(arch, self._models[arch], sock_dir)
        self.starts.append(arch)
        return self._live

    def close(self) -> None:
        if self._live is not None:
            stop_engine(self._live)
            self._live = None


def preemptions(llm) -> int:
    """How many times the engine preempted a request so far (vLLM's own counter)."""
    total = 0
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            total += int(getattr(m, "value", 0))
    return total
