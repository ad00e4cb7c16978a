"""fs-sink through the real bus: a real Publisher in this process, ``actbus run
fs-sink`` processes, real files. Round trip of every dtype and reduction, rotation,
compression, marked requests with a real second subscriber, replay."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch

from actbus.bus import Subscriber, Subscription
from consumers.fs import ActivationRun
from consumers.fs.reductions import projection_matrix
from tests.support.fs_procs import (
    HIDDEN,
    log_of,
    publisher,
    sink,
    step_message,
    wait_exit,
    wait_sent,
)
from tests.support.procs import ROOT

TAGS = [{"split": "train", "n": 1}, {"split": "eval"}]


def _publish_steps(pub, steps: int, dtype: str = "float32", layers=(0,), hooks=("post_block",)):
    """Two requests per message; returns {(step, layer, hook): (header, tensor)}."""
    sent = {}
    for s in range(steps):
        reqs = [("a", 0, 4 * s, TAGS[0]), ("b", 1, 4 * s, TAGS[1])]
        for layer in layers:
            for hook in hooks:
                h, t = step_message(s, reqs, layer=layer, hook=hook, dtype=dtype)
                pub.publish(h, t)
                sent[(s, layer, hook)] = (h, t)
    return sent


def _stored(run: ActivationRun) -> pa.Table:
    t = run.dataset().to_table()
    keys = ["step", "layer", "hook", "request_id", "sample_index", "position"]
    return t.sort_by([(k, "ascending") for k in keys])


def _expected(sent) -> torch.Tensor:
    """The published rows in the order ``_stored`` sorts them."""
    rows = []
    for key in sorted(sent):
        h, t = sent[key]
        ids = h.rows.row_request_ids()
        order = sorted(range(len(ids)), key=lambda i: (ids[i], int(h.rows.positions[i])))
        rows.append(t[order])
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("dtype", "compression"),
    [("float32", "none"), ("float16", "zstd"), ("bfloat16", "lz4")],
)
def test_round_trip_exact_through_the_bus(tmp_path, dtype, compression):
    out = tmp_path / "run"
    pub = publisher(f"ipc://{tmp_path}/bus.sock", dtype=dtype)
    try:
        proc = sink(
            pub.address, out, "--shard-rows", "20", "--compression", compression,
            "--tag-columns", "split",
        )  # fmt: skip
        sent = _publish_steps(pub, 12, dtype)
    finally:
        pub.close()
    assert wait_exit(proc, out) == 0, log_of(out)
    run = ActivationRun(out)
    assert run.verify() == []
    table = _stored(run)
    assert table.num_rows == 12 * 8 == run.manifest["total_rows"]
    got = run.decode(table)
    assert got.dtype == getattr(torch, dtype) and torch.equal(got, _expected(sent))
    # rotation by rows: shards of 20 rows or a message more, never one giant shard
    sizes = [s["rows"] for s in run.manifest["shards"]]
    assert len(sizes) >= 4 and max(sizes) < 20 + 8
    # tags as a JSON column and as a column of their own; sample index kept
    a = table.filter(pa.compute.equal(table.column("request_id"), "a"))
    assert [json.loads(x) for x in set(a.column("tags").to_pylist())] == [TAGS[0]]
    assert set(table.column("tag_split").to_pylist()) == {"train", "eval"}
    assert set(a.column("sample_index").to_pylist()) == {0}
    b_rows = table.filter(pa.compute.equal(table.column("request_id"), "b"))
    assert set(b_rows.column("sample_index").to_pylist()) == {1}
    for p in run.shards():  # compressed on disk: the same table written plainly is larger
        sink_ = pa.BufferOutputStream()
        with pa.ipc.new_file(sink_, run.read(p).schema) as w:
            w.write_table(run.read(p))
        plain = sink_.getvalue().size
        assert (p.stat().st_size < plain) == (compression != "none")


def test_every_reduction_round_trip_with_error_bounds(tmp_path):
    """One float32 stream, one sink process per reduction, all at once."""
    pub = publisher(f"ipc://{tmp_path}/bus.sock")
    specs = {
        "fp16": [],
        "bf16": [],
        "int8": [],
        "proj:16": ["--reduce-seed", "7"],
        "pca:8": ["--pca-warmup", "64"],
        "topk:8": [],
    }
    procs = {}
    try:
        for spec, extra in specs.items():
            out = tmp_path / spec.replace(":", "_")
            procs[spec] = (
                sink(pub.address, out, "--reduce", spec, "--shard-rows", "50", *extra),
                out,
            )
        sent = _publish_steps(pub, 40)
    finally:
        pub.close()
    x = _expected(sent)
    errors = {}
    for spec, (proc, out) in procs.items():
        assert wait_exit(proc, out) == 0, log_of(out)
        run = ActivationRun(out)
        assert run.verify() == [] and run.manifest["total_rows"] == x.shape[0]
        got = run.decode(_stored(run))
        if spec == "fp16":
            assert torch.equal(got, x.half())
        elif spec == "bf16":
            assert torch.equal(got, x.bfloat16())
        elif spec == "int8":
            bound = x.abs().amax(1, keepdim=True) / 127 / 2
            assert ((got - x).abs() <= bound * 1.0001 + 1e-6).all()
        elif spec == "proj:16":
            assert got.shape == (x.shape[0], 16)  # the reduced space
            assert torch.allclose(got, x @ projection_matrix(HIDDEN, 16, 7), rtol=1e-4, atol=1e-4)
            ratio = got.norm(dim=1) / x.norm(dim=1)
            assert (ratio - 1).abs().mean() < 0.5
            errors[spec] = float((ratio - 1).abs().mean())
            continue
        elif spec == "pca:8":
            assert run.manifest["bases"]["L0.post_block"]["fitted_rows"] >= 64
            rel = (got - x).norm() / x.norm()
            assert rel < 0.05  # rank-4 data, 8 components: only the noise is lost
        elif spec == "topk:8":
            kept = got != 0
            assert (kept.sum(1) == 8).all()
            assert torch.equal(got[kept], x[kept])  # kept values exact
            smallest_kept = got.abs().masked_fill(~kept, float("inf")).amin(1)
            largest_dropped = x.abs().masked_fill(kept, 0).amax(1)
            assert (smallest_kept >= largest_dropped).all()
        errors[spec] = float((got.float() - x).norm() / x.norm())
    print(json.dumps({"relative_error": errors}))


def test_marked_requests_kept_exactly(tmp_path):
    """--keep marked: a tag at submission, a mark while held, a mark before the rows,
    and a mark after eviction (counted, logged); a real second subscriber marks."""
    pub = publisher(f"ipc://{tmp_path}/bus.sock")
    out = tmp_path / "run"
    probe = None
    try:
        proc = sink(
            pub.address, out, "--keep", "marked", "--keep-match", "keep=true",
            "--window-requests", "3",
        )  # fmt: skip
        probe = Subscriber(pub.address, Subscription(layers=(), name="probe"))
        probe.wait_welcome(30)
        step = 0
        published = 0

        def put(*reqs):
            nonlocal step, published
            pub.publish(*step_message(step, [(r, 0, 4 * step, t) for r, t in reqs]))
            step += 1
            published += 1
            wait_sent(pub, "fs-sink", published)

        from tests.support.procs import manifest, wait_for

        def mark(rid: str, why: str) -> None:
            """A mark, through the publisher before the next step (on a loaded machine
            the probe's socket may lag the test's own publishing)."""
            n = pub.stats().get("marks", 0)
            probe.mark(rid, 0, why)
            wait_for(lambda: pub.stats().get("marks", 0) > n, 30, f"the mark of {rid}")

        put(("tagged", {"keep": True}), ("plain", {}))
        put(("held", {}), ("evicted", {"keep": False}))
        mark("held", "probe fired")
        put(("held", {}))  # after the mark: stored directly
        mark("early", "before any row")
        for i in range(4):  # pushes 'evicted' (and 'plain') out of a 3-request window
            put((f"filler{i}", {}))
        mark("evicted", "too late")
        put(("early", {}), ("tagged", {"keep": True}))
        put(("late-filler", {}))
        # the mark for "evicted" has reached the sink once its window counters show it

        pub.publish(*step_message(step, [("plain", 0, 0, {})]))
        wait_for(
            lambda: (manifest(out) or {}).get("counters", {}).get("window_marks", 0) >= 3,
            30,
            "the sink to see 3 marks",
        )
    finally:
        if probe is not None:
            probe.close()
        pub.close()
    assert wait_exit(proc, out) == 0, log_of(out)
    run = ActivationRun(out)
    assert run.verify() == []
    assert run.request_ids() == ["early", "held", "tagged"]
    assert run.request_rows("held", 0)[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert run.request_rows("tagged", 0)[0].size == 8
    c = run.manifest["counters"]
    assert c["window_marks"] == 3 and c["window_kept_by_mark"] == 1
    assert c["window_marks_before_rows"] == 1 and c["window_marks_after_eviction"] == 1
    assert c["window_kept_by_tag"] == 1 and c["window_evicted_requests"] >= 3
    assert "came after it left the window" in log_of(out)


def test_replay_into_a_second_sink_gives_identical_rows(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    pub = publisher(f"ipc://{tmp_path}/a.sock", dtype="bfloat16")
    try:
        proc = sink(pub.address, first, "--shard-rows", "24", "--tag-columns", "split")
        _publish_steps(pub, 6, "bfloat16", layers=(0, 2), hooks=("post_block", "mlp_out"))
    finally:
        pub.close()
    assert wait_exit(proc, first) == 0, log_of(first)
    address = f"ipc://{tmp_path}/b.sock"
    replay = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "replay", str(first), "--publish", address,
         "--rate", "50", "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        proc = sink(address, second, "--shard-rows", "24", "--tag-columns", "split")
        stdout, stderr = replay.communicate(timeout=60)
    finally:
        if replay.poll() is None:
            replay.kill()
    assert replay.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["messages"] == 24 and summary["rows"] == 192
    assert wait_exit(proc, second) == 0, log_of(second)
    a, b = _stored(ActivationRun(first)), _stored(ActivationRun(second))
    assert a.num_rows == 192 and a.equals(b.select(a.column_names))
    assert ActivationRun(second).manifest["dtype"] == "bfloat16"
    assert not np.array_equal(a.column("layer").to_numpy(), np.zeros(a.num_rows))


def test_layers_and_hooks_selected_at_the_publisher(tmp_path):
    out = tmp_path / "run"
    pub = publisher(f"ipc://{tmp_path}/bus.sock")
    try:
        proc = sink(pub.address, out, "--layers", "2", "--hooks", "mlp_out")
        _publish_steps(pub, 5, layers=(0, 2), hooks=("post_block", "mlp_out"))
        wait_sent(pub, "fs-sink", 5)
        routed = pub.stats()["subscribers"]["fs-sink"]["routed"]
    finally:
        pub.close()
    assert wait_exit(proc, out) == 0, log_of(out)
    assert routed == 5  # the other 15 messages never crossed the bus to the sink
    run = ActivationRun(out)
    assert run.manifest["rows"] == {"L2.mlp_out": 40} and run.verify() == []


def test_replay_of_a_non_run_is_named(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "actbus.cli", "replay", str(tmp_path), "--publish",
         f"ipc://{tmp_path}/r.sock", "--wait-s", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and f"{tmp_path}: no manifest.json" in r.stderr, r.stderr
