"""Helpers that run real consumer processes and subscribers, and wait on them with deadlines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from actbus.bus import Batch, Subscriber
from actbus.cli import consumer_command
from actbus.streams import point_key

ROOT = Path(__file__).resolve().parents[2]


def start_sink(address: str, out: Path, *extra: str, policy: str = "block") -> subprocess.Popen:
    """``actbus run fs-sink`` as its own process, as a user would start it."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "wb")  # noqa: SIM115 (lives with the process)
    return subprocess.Popen(
        consumer_command(
            "fs-sink", address, "--out", str(out), "--policy", policy, "--flush-s", "0.5", *extra
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM (the sink flushes and exits), then SIGKILL if it does not."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def recv_batches(sub: Subscriber, n: int, timeout: float = 10.0) -> list[Batch]:
    """Up to ``n`` batches from ``sub``, whatever arrived before ``timeout``."""
    got: list[Batch] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        out = sub.recv(timeout=0.2)
        if isinstance(out, Batch):
            got.append(out)
    return got


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until the OpenAI server at ``url`` answers ``/health``; its process exiting first,
    or ``timeout`` s passing, raises with the tail of its ``log``."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not healthy within {timeout:.0f} s")
        time.sleep(1)


@contextmanager
def actbus_serve(model: Path, log: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``actbus serve MODEL ARGS`` on a free loopback port, started as a user starts it:
    (its base URL, its process) once healthy; stopped (SIGTERM, then SIGKILL) after."""
    port = free_port()
    out = open(log, "w")  # noqa: SIM115 (closed below)
    cmd = [sys.executable, "-m", "actbus.cli", "serve", str(model), *args,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}  # the worker's actbus line is INFO
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log, 300)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


def manifest(out: Path) -> dict[str, Any] | None:
    p = out / "manifest.json"
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_rows(out: Path, layer: int, at_least: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the sink has committed ``at_least`` rows of ``layer`` and stopped growing."""
    key = point_key(layer, "post_block")

    def enough():
        m = manifest(out)
        return m if m and m["rows"].get(key, 0) >= at_least else None

    wait_for(enough, timeout, f"{at_least} rows of layer {layer} in {out}")
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:  # settle: extra rows are a bug the caller should see
        m = manifest(out)
        if m["total_rows"] == last:
            return m
        last = m["total_rows"]
        time.sleep(1.0)
    raise TimeoutError(f"rows in {out} kept growing for {timeout}s")
