"""Runs written before the one stream name (``RUN/layer-03/post_block/``,
``reductions/layer-03-post_block.safetensors``, manifest keys ``3/post_block``) keep
loading through every reader, and a sink appending to one keeps its directories."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from actbus.bus import Batch
from actbus.wire import Header, RowIndex
from consumers.fs import ActivationRun, FsSink, WriterConfig, layout, writer
from consumers.fs.reductions import parse_reduction
from consumers.fs.replay import ReplayConfig, replay
from consumers.fs.torch_dataset import TokenDataset

HIDDEN = 8
INFO = {"model": "m", "hidden_size": HIDDEN, "dtype": "float32"}


def _batch(step: int, layer: int) -> Batch:
    positions = np.arange(step * 4, step * 4 + 4)
    ri = RowIndex(["a", "b"], np.array([0, 2, 4]), positions, positions + 7)
    h = Header(step, layer, "post_block", "float32", (4, HIDDEN), "m", ri)
    t = torch.from_numpy(positions).float()[:, None] + layer + torch.arange(HIDDEN) / 100
    return Batch(header=h, tensor=t.contiguous(), seq=step)


def _old_shard_dir(run, layer, hook):
    layout.check_tap(run, layer, hook)
    return layout.inside(run, run / f"layer-{layer:02d}" / hook)


def _old_basis_path(run, layer, hook):
    layout.check_tap(run, layer, hook)
    return layout.inside(run, run / "reductions" / f"layer-{layer:02d}-{hook}.safetensors")


def _write_old_run(path, monkeypatch, reduce: str = "none") -> None:
    """The sink as it was before the rename: its directory and key spellings."""
    with monkeypatch.context() as m:
        m.setattr(layout, "shard_dir", _old_shard_dir)
        m.setattr(layout, "basis_path", _old_basis_path)
        m.setattr(writer, "point_key", lambda layer, hook: f"{layer}/{hook}")
        cfg = WriterConfig(shard_rows=6, reduction=parse_reduction(reduce, warmup=8))
        sink = FsSink(str(path), cfg)
        sink.on_welcome(INFO)
        for s in range(5):
            for layer in (1, 3):
                sink.on_batch(_batch(s, layer))
        sink.close()


@pytest.mark.parametrize("reduce", ["none", "pca:4"])
def test_an_old_layout_run_reads_through_every_reader(tmp_path, monkeypatch, reduce):
    out = tmp_path / "run"
    _write_old_run(out, monkeypatch, reduce)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert set(on_disk["rows"]) == {"1/post_block", "3/post_block"}  # what old sinks wrote
    assert all(
        s["path"].startswith(("layer-01/post_block/", "layer-03/post_block/"))
        for s in on_disk["shards"]
    )
    assert not list(out.glob("L*.*"))
    if reduce != "none":
        assert (out / "reductions" / "layer-03-post_block.safetensors").exists()

    run = ActivationRun(out)
    assert run.manifest["rows"] == {"L1.post_block": 20, "L3.post_block": 20}
    assert run.verify() == []
    positions, x = run.request_rows("a", 3)
    assert positions.tolist() == [p for s in range(5) for p in (4 * s, 4 * s + 1)]
    want = torch.from_numpy(positions.copy()).float()[:, None] + 3 + torch.arange(HIDDEN) / 100
    if reduce == "none":
        assert torch.equal(x, want)
    else:  # decoded through the basis the old manifest names: the rows are rank 2
        assert torch.allclose(x, want, atol=1e-3)
    rows = sum(len(b["request_id"]) for b in TokenDataset(out, 1, batch_tokens=7))
    assert rows == 20
    got = replay(
        ReplayConfig(run=out, address=f"ipc://{tmp_path}/bus.sock", wait_subscribers=0, drain_s=5.0)
    )
    assert got["rows"] == 40 and got["steps"] == 5
    d = datasets.load_dataset(
        "arrow",
        data_files=[str(p) for p in run.shards(1)],
        split="train",
        cache_dir=str(tmp_path / "c"),
    )
    assert d.num_rows == 20


def test_a_sink_appending_to_an_old_run_keeps_its_directories(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _write_old_run(out, monkeypatch)
    stray = out / "layer-01" / "post_block" / "shard-000099.arrow.tmp"  # a crash mid-write
    stray.write_bytes(b"half")
    sink = FsSink(str(out), WriterConfig(shard_rows=6, reduction=parse_reduction("none", warmup=8)))
    sink.on_welcome(INFO)
    sink.on_batch(_batch(5, 1))
    sink.on_batch(_batch(5, 2))  # a stream the old run never had: the new name
    sink.close()
    assert not stray.exists()
    run = ActivationRun(out)
    assert run.manifest["rows"] == {"L1.post_block": 24, "L2.post_block": 4, "L3.post_block": 20}
    on_disk = json.loads((out / "manifest.json").read_text())
    assert set(on_disk["rows"]) == {"L1.post_block", "L2.post_block", "L3.post_block"}
    assert {s["path"].split("/shard-")[0] for s in on_disk["shards"]} == {
        "layer-01/post_block",
        "L2.post_block",
        "layer-03/post_block",
    }
    assert run.verify() == [] and run.request_rows("a", 1)[0].tolist()[-2:] == [20, 21]
