"""A hostile publisher against a real ``actbus run fs-sink`` process.

A raw ZeroMQ ROUTER speaks the bus protocol (HELLO in, WELCOME, DATA and END out)
and sends, between good messages, one message of each malformed header class: a
hook that climbs out of the run or names an absolute path, negative and huge
layers, an unknown dtype, zero and negative widths, shapes that disagree with
the payload or the row index, oversized strings, too many tags. The sink must
create nothing outside its run directory, refuse each bad message with an error
naming its field and count it in the run's manifest, and store every good one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from actbus.wire import (
    DATA,
    END,
    HELLO,
    MARK,
    REJECT,
    SCHEMA_VERSION,
    WELCOME,
    Header,
    RowIndex,
    pack_seq,
)
from consumers.fs import ActivationRun
from tests.support.procs import manifest, start_sink, stop, wait_for

HIDDEN = 16
ROWS = 4


def good(step: int, rid: str | None = None) -> tuple[dict, bytes]:
    """A valid message of request ``rid`` (``g{step}``): its header map and its tensor
    bytes."""
    ri = RowIndex([rid or f"g{step}"], np.array([0, ROWS]), np.arange(ROWS), np.arange(ROWS) + 7)
    h = Header(step, 0, "post_block", "float32", (ROWS, HIDDEN), "hostile", ri)
    return msgpack.unpackb(h.encode()), torch.full((ROWS, HIDDEN), float(step)).numpy().tobytes()


def bad_classes(tmp_path: Path) -> list[tuple[str, str, object]]:
    """``(class, field the error names, mutation of a good message)``."""

    def header(key, value):
        def apply(d, t):
            d[key] = value
            return d, t

        return apply

    def rows(key, value):
        def apply(d, t):
            d["rows"][key] = value
            return d, t

        return apply

    def payload(d, t):
        return d, t[: len(t) // 2]  # half the bytes the shape says

    return [
        ("hook climbing out of the run", "hook", header("hook", "../../../escaped")),
        ("hook naming an absolute path", "hook", header("hook", str(tmp_path / "abs"))),
        ("negative layer", "layer", header("layer", -1)),
        ("huge layer", "layer", header("layer", 1 << 40)),
        ("unknown dtype", "dtype", header("dtype", "int64")),
        ("zero width", "shape", header("shape", [ROWS, 0])),
        ("negative width", "shape", header("shape", [ROWS, -HIDDEN])),
        ("shape against the payload", "shape", payload),
        ("shape against the row index", "shape", header("shape", [ROWS + 1, HIDDEN])),
        ("oversized model name", "model", header("model", "m" * 10_000_000)),
        ("oversized request id", "request_ids", rows("request_ids", ["r" * 1_000_000])),
        ("oversized tag value", "tags", rows("tags", [{"note": "v" * 100_000}])),
        ("too many tags", "tags", rows("tags", [{f"k{i}": i for i in range(5000)}])),
        ("oversized end reason", "ended", header("ended", [["g0", 0, "x" * 100_000]])),
    ]


class HostilePublisher:
    """A ROUTER posing as the publisher: it welcomes one subscriber, then sends what
    it is told, no questions asked."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(address)
        self.ident: bytes | None = None

    def hello(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.ident is None:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), "no HELLO from the sink"
            frames = self.sock.recv_multipart()
            if frames[1] == HELLO:
                self.ident = frames[0]

    def welcome(
        self, timeout: float, publisher_id: str = "hostile", heartbeat_s: float = 5.0
    ) -> None:
        self.hello(timeout)
        info = {
            "schema": SCHEMA_VERSION,
            "publisher_id": publisher_id,
            "heartbeat_s": heartbeat_s,
            "next_seq": 0,
            "model": "hostile",
            "hidden_size": HIDDEN,
            "dtype": "float32",
        }
        self.sock.send_multipart([self.ident, WELCOME, msgpack.packb(info)])

    def data(self, seq: int, header: dict, tensor: bytes) -> None:
        frames = [DATA, pack_seq(seq, bytes(8)), msgpack.packb(header), tensor]
        self.sock.send_multipart([self.ident, *frames])

    def control(self, tag: bytes, body: dict) -> None:
        self.sock.send_multipart([self.ident, tag, msgpack.packb(body)])

    def end(self) -> None:
        self.control(END, {})

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (symlinks not followed): size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = (Path(dirpath) / name).lstat()
            out[str((Path(dirpath) / name).relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.timeout(180)
def test_fs_sink_refuses_every_malformed_header_and_stays_in_its_run(tmp_path):
    out = tmp_path / "work" / "run"
    log = tmp_path / "work" / "run.log"  # start_sink's log, beside the run
    pub = HostilePublisher(f"ipc://{tmp_path}/bus.sock")
    proc = start_sink(f"ipc://{tmp_path}/bus.sock", out, "--exit-on-end", "--shard-rows", "8")
    classes = bad_classes(tmp_path)
    try:
        pub.welcome(60)
        wait_for(lambda: (manifest(out) or {}).get("sessions"), 60, "the sink's first manifest")
        before = tree(tmp_path)
        seq = 0
        for i, (_, _, mutate) in enumerate(classes):
            d, t = good(i)
            pub.data(seq, d, t)
            seq += 1
            pub.data(seq, *mutate(*good(1000 + i)))  # refused: the seq stays unused
        d, t = good(len(classes))
        pub.data(seq, d, t)
        pub.end()
        wait_for(lambda: proc.poll() is not None, 90, "the sink to store and exit at END")
    finally:
        rc = stop(proc)
        pub.close()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    after = tree(tmp_path)
    outside = sorted(
        p for p in set(after) - set(before) if not p.startswith("work/run/") and p != "work/run"
    )
    assert outside == [], outside  # nothing created outside the run directory
    changed = [
        p
        for p in before
        if not p.startswith("work/run") and p not in ("work", "bus.sock") and after[p] != before[p]
    ]
    assert changed == [], changed  # nothing outside it replaced (its log aside)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "abs").exists()

    run = ActivationRun(out)
    counters = run.manifest["counters"]
    assert counters["messages_rejected"] == len(classes), counters
    for field in {f for _, f, _ in classes}:
        want = sum(f == field for _, f, _ in classes)
        assert counters.get(f"messages_rejected_{field}") == want, (field, counters)
        # each kind of refusal is named in the log, with the field at fault
        assert f"for {field}): header field '{field}'" in text or (
            field == "shape" and "for shape): tensor frame has" in text
        ), (field, text[-3000:])
    assert len(text) < 100_000  # a 10 MB field is never quoted whole
    assert run.manifest["hooks"] == ["post_block"] and run.manifest["layers"] == [0]
    assert run.verify() == []
    table = run.dataset().to_table(columns=["step", "request_id"])
    n_good = len(classes) + 1
    assert sorted(set(table.column("step").to_pylist())) == list(range(n_good))
    assert table.num_rows == n_good * ROWS == run.manifest["total_rows"]
    for step in (0, n_good - 1):  # the first and the last good message, exactly
        positions, x = run.request_rows(f"g{step}", 0)
        assert positions.tolist() == list(range(ROWS)) and torch.equal(
            x, torch.full((ROWS, HIDDEN), float(step))
        )


@pytest.mark.timeout(180)
def test_bad_marks_are_counted_and_huge_fields_never_reach_the_log(tmp_path):
    """Marks are relayed from any subscriber: one with a 1 MB request id, one whose
    sample index is a string, one with 10 MB of reason; the sink keeping only marked
    requests counts the bad ones, keeps the good one, and logs a few lines."""
    out = tmp_path / "run"
    pub = HostilePublisher(f"ipc://{tmp_path}/bus.sock")
    proc = start_sink(f"ipc://{tmp_path}/bus.sock", out, "--exit-on-end", "--keep", "marked")
    try:
        pub.welcome(60)
        wait_for(lambda: (manifest(out) or {}).get("sessions"), 60, "the sink's first manifest")
        for step in range(3):
            pub.data(step, *good(step))
        pub.control(MARK, {"request_id": "r" * 1_000_000, "sample_index": 0})
        pub.control(MARK, {"request_id": "g1", "sample_index": "0"})
        pub.control(MARK, {"request_id": "g1", "sample_index": 0, "reason": "y" * 10_000_000})
        pub.end()
        wait_for(lambda: proc.poll() is not None, 90, "the sink to exit at END")
    finally:
        rc = stop(proc)
        pub.close()
    text = (tmp_path / "run.log").read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert len(text) < 20_000, len(text)
    run = ActivationRun(out)
    assert run.manifest["counters"]["marks_refused"] == 2
    assert run.request_ids(0) == ["g1"]  # the good mark kept its request, the rest let go


@pytest.mark.timeout(120)
def test_a_refusal_with_a_10_mb_reason_is_quoted_short(tmp_path):
    out = tmp_path / "run"
    pub = HostilePublisher(f"ipc://{tmp_path}/bus.sock")
    proc = start_sink(f"ipc://{tmp_path}/bus.sock", out)
    try:
        pub.hello(60)
        pub.control(REJECT, {"reason": "go away " + "x" * 10_000_000})
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
        pub.close()
    text = (tmp_path / "run.log").read_text(errors="replace")
    assert rc == 1 and "refused: go away xxx" in text, text[-2000:]
    assert len(text) < 20_000, len(text)


@pytest.mark.timeout(180)
def test_a_restarted_publisher_with_the_same_id_is_never_merged_into_the_stream(tmp_path):
    """Issue 33, LOW: a publisher restarted under the ``publisher_id`` of the run being
    written (forged, or kept) was merged into that run's stream, its steps from 0 among
    the first run's, and ``verify()`` called it clean. Now its rows are a stream of
    their own (``streams_split``), replayed apart; a step that goes back again before
    another WELCOME is refused and counted."""
    address, out = f"ipc://{tmp_path}/bus.sock", tmp_path / "run"
    proc = start_sink(address, out, "--exit-on-end", "--shard-rows", "8")
    first = HostilePublisher(address)
    try:
        first.welcome(60, publisher_id="run-a", heartbeat_s=0.1)
        for step in range(10):
            first.data(step, *good(step))
        wait_for(lambda: (manifest(out) or {}).get("total_rows", 0) >= 8, 60, "a first shard")
        first.close()  # killed: silent, no END
        second = HostilePublisher(address)  # restarted, with the same id
        try:
            # The sink hears nothing for its silence limit (3 s), then says HELLO again.
            second.welcome(60, publisher_id="run-a", heartbeat_s=0.1)
            for seq, step in enumerate([0, 1, 2, 3, 4, 2]):  # the last goes back again
                second.data(seq, *good(step, f"b{seq}"))
            second.end()
            wait_for(lambda: proc.poll() is not None, 90, "the sink to store and exit at END")
        finally:
            second.close()
    finally:
        rc = stop(proc)
    text = (tmp_path / "run.log").read_text(errors="replace")
    assert rc == 0, text[-3000:]
    run = ActivationRun(out)
    assert run.manifest["streams"] == ["run-a", "run-a"], run.manifest["streams"]
    counters = run.manifest["counters"]
    assert counters["streams_split"] == 1 and counters["rows_refused_step_order"] == ROWS
    by_stream: dict[int, set[int]] = {}
    for s in run.manifest["shards"]:
        by_stream.setdefault(s["stream"], set()).update(range(s["steps"][0], s["steps"][1] + 1))
    assert by_stream == {0: set(range(10)), 1: set(range(5))}, by_stream
    assert run.verify() == []
    assert "another run under publisher id 'run-a'" in text
