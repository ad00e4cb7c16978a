"""Helpers of the fs-sink tests: a real publisher of synthetic steps, sink processes.

Synthetic activations are low rank plus noise (so PCA has something to find) and
every row is a known function of its (step, layer, hook, row), so what comes back
from disk can be compared with what was published.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from actbus.bus import Publisher
from actbus.wire import DTYPES, Header, RowIndex
from tests.support.procs import manifest, start_sink, wait_for

HIDDEN = 64


class _Publisher(Publisher):
    """Closes with a long wait: sinks must acknowledge everything before END."""

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)


def publisher(address: str, dtype: str = "float32", hidden: int = HIDDEN, **kw) -> Publisher:
    info = {"model": "synthetic", "hidden_size": hidden, "dtype": dtype}
    return _Publisher(address, info=info, heartbeat_s=0.1, **kw)


def activations(seed: int, rows: int, hidden: int = HIDDEN) -> torch.Tensor:
    """Rank-4 structure plus 1% noise, scaled per row (int8 per-row scales differ)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(rows, 4, generator=g) @ basis + 0.01 * torch.randn(rows, hidden, generator=g)
    return x * (1 + torch.rand(rows, 1, generator=g) * 10)


def step_message(
    step: int,
    requests: list[tuple[str, int, int, dict]],
    *,
    layer: int = 0,
    hook: str = "post_block",
    dtype: str = "float32",
    hidden: int = HIDDEN,
) -> tuple[Header, torch.Tensor]:
    """One message: ``requests`` are ``(id, sample_index, first position, tags)``,
    each with 4 rows (positions first..first+3)."""
    n_per = 4
    offsets = np.arange(len(requests) + 1, dtype=np.int64) * n_per
    positions = np.concatenate([np.arange(p, p + n_per) for _, _, p, _ in requests])
    ri = RowIndex(
        [r for r, _, _, _ in requests],
        offsets,
        positions.astype(np.int64),
        (positions * 7 + step).astype(np.int64),
        sample_index=[s for _, s, _, _ in requests],
        tags=[t for _, _, _, t in requests],
    )
    n = int(offsets[-1])
    seed = step * 1000 + layer * 10 + len(hook)
    t = activations(seed, n, hidden).to(DTYPES[dtype])
    return Header(step, layer, hook, dtype, (n, hidden), "synthetic", ri), t


def sink(address: str, out: Path, *flags: str, policy: str = "block") -> subprocess.Popen:
    """``actbus run fs-sink`` that exits at the publisher's END; returns once it
    is subscribed (its manifest shows a new session)."""
    before = (manifest(out) or {}).get("sessions", 0)
    proc = start_sink(address, out, "--exit-on-end", *flags, policy=policy)

    def subscribed():
        if proc.poll() is not None:
            log = (out.parent / f"{out.name}.log").read_text()
            raise AssertionError(f"sink exited early ({proc.returncode}): {log[-2000:]}")
        m = manifest(out)
        return m is not None and m.get("sessions", 0) > before

    wait_for(subscribed, 60, f"the sink on {out} to subscribe")
    return proc


def wait_exit(proc: subprocess.Popen, out: Path, timeout: float = 60.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        log = (out.parent / f"{out.name}.log").read_text()
        raise AssertionError(f"sink did not exit within {timeout}s: {log[-2000:]}") from None


def wait_sent(pub: Publisher, name: str, messages: int, timeout: float = 30.0) -> None:
    """Until ``messages`` messages were sent to subscriber ``name``."""

    def sent():
        s = pub.stats()["subscribers"].get(name)
        return s is not None and s["sent"] >= messages

    wait_for(sent, timeout, f"{messages} messages sent to {name}", interval=0.02)


def log_of(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()


def settle(seconds: float = 0.2) -> None:
    time.sleep(seconds)
