"""Returned rows received in a child process (``ProcessReturnCollector``), against a
real publisher: every row once and in order through DELTA outputs, rows sent before
their request's registration, regions that outgrow their budget, views that outlive
their request (and the slab's reuse), a child that dies, and no process left behind."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from actbus.bus import Publisher
from actbus.capture import retchild
from actbus.capture.retproc import ProcessReturnCollector, ReturnReceiverError
from actbus.capture.selection import Selection
from actbus.wire import Header, RequestEnd, RowIndex

TAPS = ((0, "post_block"), (3, "post_block"))
SEL = Selection(layers=(0, 3), hooks=("post_block",))


def _send(pub: Publisher, step: int, fed: dict[str, list[int]], ended=()) -> None:
    """Rows of several requests at both taps; each row's values name its request,
    position and layer (request ``rN`` -> N)."""
    ids = list(fed)
    counts = [len(fed[r]) for r in ids]
    positions = np.array([p for r in ids for p in fed[r]], dtype=np.int64)
    ri = RowIndex(
        ids,
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        positions,
        positions + 100,
        returned=[True] * len(ids),
    )
    owner = [int(r[1:]) for r in ids for _ in fed[r]]
    ends = [RequestEnd(r, 0, "stop") for r in ended]
    for layer, hook in TAPS:
        x = torch.tensor(
            [[float(o), float(p), float(layer), 0.5] for o, p in zip(owner, positions, strict=True)]
        ).reshape(-1, 4)
        pub.publish(Header(step, layer, hook, "float32", tuple(x.shape), "m", ri, ended=ends), x)


def _check(acts, r: int, want: list[int]) -> None:
    assert acts.positions.tolist() == want, r
    assert acts.token_ids.tolist() == [p + 100 for p in want]
    for layer, hook in TAPS:
        t = acts.tensors[(layer, hook)]
        assert t.shape == (len(want), 4)
        assert t[:, 0].eq(r).all() and t[:, 2].eq(layer).all(), (r, layer)
        assert t[:, 1].tolist() == [float(p) for p in want], (r, layer)


@pytest.fixture
def bus(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    yield address, pub
    pub.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone too (reaped by its parent's wait)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "Z"


def test_delta_outputs_every_row_once_early_rows_growth_and_views_that_outlive(bus):
    address, pub = bus
    col = ProcessReturnCollector(address, slab_bytes=64 * (16 + 16))  # 64 rows a slab
    prompt, gen = 5, 40
    pid = col.pid
    files = col._dir
    try:
        # r0 asks for 4 tokens and gets 40 (its region grows, more than once, and
        # moves to other slabs); r1's prefill arrives before its registration.
        col.expect("r0", 1, SEL, prompt, max_tokens=4)
        _send(pub, 0, {"r0": list(range(prompt)), "r1": list(range(prompt))})
        time.sleep(0.3)
        col.expect("r1", 1, SEL, prompt, max_tokens=gen)
        got: dict[int, list] = {0: [], 1: []}
        for n in range(1, gen + 1):
            if n > 1:
                _send(pub, n - 1, {f"r{r}": [prompt + n - 2] for r in (0, 1)})
            limit = prompt + n - 1
            for r in (0, 1):
                deadline = time.monotonic() + 10
                while sum(len(a.positions) for a in got[r]) < limit:
                    got[r].append(col.take(f"r{r}", 0, n, final=False, delta=True))
                    assert time.monotonic() < deadline, (r, n)
        _send(pub, gen, {"r0": [prompt + gen - 1], "r1": [prompt + gen - 1]}, ended=("r0", "r1"))
        for r in (0, 1):
            last = col.take(f"r{r}", 0, gen + 1, final=True, delta=True)
            assert last.complete
            got[r].append(last)
        assert col.pending() == 0
        # Requests that come next fill (and free) slabs again; the views kept are intact.
        for r in range(2, 6):
            col.expect(f"r{r}", 1, SEL, prompt, max_tokens=gen)
        _send(pub, 100, {f"r{r}": list(range(prompt + gen)) for r in range(2, 6)},
              ended=[f"r{r}" for r in range(2, 6)])  # fmt: skip
        for r in range(2, 6):
            acts = col.take(f"r{r}", 0, gen + 1, final=True, delta=False)
            assert acts.complete
            _check(acts, r, list(range(prompt + gen)))
        for r in (0, 1):
            pieces = got[r]
            from actbus.capture.returns import Activations

            joined = None
            for p in pieces:
                joined = Activations.join(joined, p)
            _check(joined, r, list(range(prompt + gen)))  # every row once, in order
        assert col.stats()["recv_messages"] > 0
        # Only slabs holding registered requests' rows stay: none now.
        time.sleep(0.3)
        assert not [f for f in os.listdir(files) if f.startswith("slab")], os.listdir(files)
    finally:
        col.close()
    assert _gone(pid)
    assert not os.path.exists(files)


def test_a_dead_receiver_is_an_error_not_a_hang(bus):
    address, _pub = bus
    col = ProcessReturnCollector(address)
    try:
        col.expect("r0", 1, SEL, 3, max_tokens=2)
        os.kill(col.pid, signal.SIGKILL)
        col._proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ReturnReceiverError, match=r"exited with code -9"):
            col.take("r0", 0, 2, final=True, delta=False)
        with pytest.raises(ReturnReceiverError, match="restart the engine"):
            col.expect("r1", 1, SEL, 3)
        assert time.monotonic() - t0 < 2
    finally:
        col.close()
    assert not os.path.exists(col._dir)


def test_the_receiver_goes_with_its_parent(bus, tmp_path):
    """A front end killed outright leaves no receiver behind."""
    import subprocess
    import sys

    address, _pub = bus
    script = tmp_path / "fe.py"
    script.write_text(
        "import sys, time\n"
        "from actbus.capture.retproc import ProcessReturnCollector\n"
        f"col = ProcessReturnCollector({address!r})\n"
        "print(col.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert not _gone(child)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, "the receiver outlived its parent"
            time.sleep(0.1)
    finally:
        proc.kill()


def test_stash_is_bounded(monkeypatch):
    """Rows of requests never registered are kept only up to a bound."""
    import mmap

    monkeypatch.setattr(retchild, "STASH_BYTES", 1000)
    rec = retchild.Receiver.__new__(retchild.Receiver)
    mem = mmap.mmap(-1, retchild.HEADER * 8)
    rec.head = np.frombuffer(mem, dtype=np.int64)
    rec.stash, rec.stash_bytes = {}, 0
    row = np.zeros((1, 400), np.uint8)
    for i in range(5):
        rec._stash(("x", 0), ((0, "h"), np.array([i]), np.array([i]), row, False))
    assert rec.stash_bytes <= 1000 and len(rec.stash[("x", 0)]) == 2
    assert rec.head[retchild.H_STASH_DROPPED] == 3


def test_a_long_request_does_not_keep_its_neighbours_slab(bus):
    """Once the other requests in a full slab are collected, the one left moves out:
    the slab's file goes, the survivor's rows (and a view taken before) stay right."""
    address, pub = bus
    col = ProcessReturnCollector(address, slab_bytes=64 * (16 + 16))  # 64 rows a slab
    prompt = 8
    try:
        for r in range(4):  # 16 rows a tap each: two requests' taps fill a slab
            col.expect(f"r{r}", 1, SEL, prompt, max_tokens=4)
        _send(pub, 0, {f"r{r}": list(range(prompt)) for r in range(4)}, ended=["r1", "r2"])
        early = col.take("r0", 0, 1, final=False, delta=False)
        deadline = time.monotonic() + 10
        while len(early.positions) < prompt:
            early = col.take("r0", 0, 1, final=False, delta=False)
            assert time.monotonic() < deadline
        first = col._read(col._pending[("r0", 0)].entries[TAPS[0]])[retchild.SLAB]
        _send(pub, 1, {"r3": [prompt]}, ended=["r3"])
        for r in (1, 2, 3):
            col.take(f"r{r}", 0, 1, final=True, delta=False)
        deadline = time.monotonic() + 10
        while os.path.exists(retchild.slab_path(col._prefix, int(first))):
            assert time.monotonic() < deadline, os.listdir(col._dir)
            time.sleep(0.05)
        now = col._read(col._pending[("r0", 0)].entries[TAPS[0]])[retchild.SLAB]
        assert now != first
        _send(pub, 2, {"r0": [prompt]}, ended=["r0"])
        acts = col.take("r0", 0, 2, final=True, delta=False)
        assert acts.complete
        _check(acts, 0, list(range(prompt + 1)))
        _check(early, 0, list(range(prompt)))  # a view into the slab now freed
    finally:
        col.close()
