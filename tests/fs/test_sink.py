"""The filesystem sink on real files, fed real batches (no engine needed)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from actbus.bus import Batch
from actbus.wire import Header, RowIndex
from consumers.fs import ActivationRun, FsSink, StorageError, WriterConfig, parse_reduction
from consumers.fs.filters import StoreFilter
from consumers.fs.torch_dataset import TokenDataset

INFO = {"model": "m", "hidden_size": 8, "dtype": "float32", "layers": [1], "hooks": ["post_block"]}


def _batch(step: int, rid: str, positions: list[int], dtype=torch.float32) -> Batch:
    n = len(positions)
    ri = RowIndex([rid], np.array([0, n]), np.array(positions), np.array(positions) + 10)
    name = str(dtype).removeprefix("torch.")
    h = Header(step, 1, "post_block", name, (n, 8), "m", ri)
    t = (torch.arange(n * 8, dtype=torch.float32).view(n, 8) + 100 * step).to(dtype)
    return Batch(header=h, tensor=t, seq=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_exact_and_ordered_by_position(tmp_path, dtype):
    sink = FsSink(tmp_path / "run", shard_rows=3)
    sink.on_welcome({**INFO, "dtype": str(dtype).removeprefix("torch.")})
    sink.on_batch(_batch(1, "b", [2, 3], dtype))  # out of order on purpose
    sink.on_batch(_batch(0, "b", [0, 1], dtype))
    sink.on_batch(_batch(0, "a", [0], dtype))
    sink.close()
    run = ActivationRun(tmp_path / "run")
    positions, x = run.request_rows("b", 1)
    assert positions.tolist() == [0, 1, 2, 3] and x.dtype == dtype
    expected = torch.cat(
        [_batch(0, "b", [0, 1], dtype).tensor, _batch(1, "b", [2, 3], dtype).tensor]
    )
    assert torch.equal(x, expected)
    assert run.manifest["rows"] == {"L1.post_block": 5} and len(run.shards()) >= 2
    assert not list((tmp_path / "run").rglob("*.tmp"))


def test_restart_continues_without_overwriting(tmp_path):
    out = tmp_path / "run"
    sink = FsSink(out)
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1]))
    sink.close()
    # A crash after a shard's rename but before the manifest update: a stray shard.
    stray = out / "L1.post_block" / "shard-000007.arrow"
    stray.write_bytes(b"not listed")
    sink = FsSink(out)
    sink.on_welcome(INFO)
    sink.on_batch(_batch(1, "a", [2]))
    sink.close()
    names = sorted(s["path"] for s in ActivationRun(out).manifest["shards"])
    assert names[-1].endswith("shard-000008.arrow") and stray.read_bytes() == b"not listed"
    assert ActivationRun(out).request_rows("a", 1)[0].tolist() == [0, 1, 2]


def test_second_sink_on_same_directory_is_refused(tmp_path):
    first = FsSink(tmp_path / "run")
    with pytest.raises(RuntimeError, match="another fs-sink is writing this run"):
        FsSink(tmp_path / "run")
    first.close()
    FsSink(tmp_path / "run").close()  # free again once the first is gone


def test_run_of_another_model_is_refused(tmp_path):
    sink = FsSink(tmp_path / "run")
    sink.on_welcome(INFO)
    sink.close()
    sink = FsSink(tmp_path / "run")
    with pytest.raises(RuntimeError, match="holds a run of hidden_size=8"):
        sink.on_welcome({**INFO, "hidden_size": 16})
    sink.close()


def test_rotation_by_time(tmp_path):
    sink = FsSink(str(tmp_path / "run"), flush_s=0.3)
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1]))
    sink.on_heartbeat({}, caught_up=False)
    assert ActivationRun(tmp_path / "run").manifest["shards"] == []  # young: still open
    time.sleep(0.4)
    sink.on_heartbeat({}, caught_up=False)
    sink.writer._commits.join()
    assert len(ActivationRun(tmp_path / "run").manifest["shards"]) == 1
    sink.on_batch(_batch(1, "a", [2]))
    sink.on_heartbeat({}, caught_up=True)  # caught up, but young: still open
    sink.writer._commits.join()
    assert len(ActivationRun(tmp_path / "run").manifest["shards"]) == 1
    sink.close()  # the end commits it
    assert len(ActivationRun(tmp_path / "run").manifest["shards"]) == 2


def test_restart_keeps_the_run_settings_and_the_pca_basis(tmp_path):
    out = tmp_path / "run"
    cfg = WriterConfig(reduction=parse_reduction("pca:2", warmup=4))
    sink = FsSink(str(out), cfg)
    sink.on_welcome(INFO)
    for s in range(3):
        sink.on_batch(_batch(s, "a", [2 * s, 2 * s + 1]))
    sink.close()
    basis = (out / ActivationRun(out).manifest["bases"]["L1.post_block"]["path"]).read_bytes()
    with pytest.raises(RuntimeError, match=r"written with reduction=.*pass the same flags"):
        FsSink(str(out), WriterConfig(reduction=parse_reduction("int8")))
    sink = FsSink(str(out), cfg)  # same flags: continues, with the stored basis
    sink.on_welcome(INFO)
    for s in range(3, 8):
        sink.on_batch(_batch(s, "a", [2 * s, 2 * s + 1]))
    sink.close()
    run = ActivationRun(out)
    assert (out / run.manifest["bases"]["L1.post_block"]["path"]).read_bytes() == basis
    positions, x = run.request_rows("a", 1)
    assert positions.tolist() == list(range(16)) and x.shape == (16, 8)
    assert run.verify() == []


@pytest.mark.parametrize("spec", ["int8", "topk:3", "proj:4"])
def test_token_dataset_decodes_reduced_runs(tmp_path, spec):
    out = tmp_path / "run"
    sink = FsSink(str(out), WriterConfig(reduction=parse_reduction(spec), shard_rows=4))
    sink.on_welcome(INFO)
    for s in range(4):
        sink.on_batch(_batch(s, "a", [2 * s, 2 * s + 1]))
    sink.close()
    run = ActivationRun(out)
    batches = list(TokenDataset(out, 1, batch_tokens=3, shuffle_buffer=0))
    x = torch.cat([b["activation"] for b in batches])
    assert x.shape == (8, run.width) and torch.equal(x, run.request_rows("a", 1)[1])
    assert x.abs().sum() > 0


def test_positions_selected_and_counted(tmp_path):
    sink = FsSink(str(tmp_path / "run"), store_filter=StoreFilter(position_range=(1, 3)))
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1, 2, 3]))
    sink.close()
    run = ActivationRun(tmp_path / "run")
    assert run.request_rows("a", 1)[0].tolist() == [1, 2]
    assert run.manifest["counters"]["rows_not_selected"] == 2


def test_unwritable_out_is_named(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StorageError, match=r"--out .*file/run: cannot create the run directory"):
        FsSink(str(tmp_path / "file" / "run"))


def test_mark_after_eviction_counted_even_when_later_rows_are_held_again():
    """A request evicted, then held again by its later rows, then marked: only the
    later rows are kept, and the mark is counted (and logged) as after eviction."""
    from consumers.fs.filters import MarkedWindow
    from consumers.fs.rows import TapRows

    w = MarkedWindow(1, 1 << 30, {})
    w.offer(TapRows.from_batch(_batch(0, "x", [0, 1])))
    w.offer(TapRows.from_batch(_batch(1, "y", [0, 1])))  # evicts x
    w.offer(TapRows.from_batch(_batch(2, "x", [2, 3])))  # x held again, y evicted
    released = w.mark("x", 0, "late")
    assert [p for r in released for p in r.positions.tolist()] == [2, 3]
    assert w.counts["marks_after_eviction"] == 1 and w.counts["evicted_rows"] == 4


def test_pca_rows_of_several_layers_decode_each_with_its_own_basis(tmp_path):
    """A table of the whole run (its schema names only the first shard's basis)
    decodes like each layer's own table."""
    out = tmp_path / "run"
    sink = FsSink(str(out), WriterConfig(reduction=parse_reduction("pca:2", warmup=4)))
    sink.on_welcome(INFO)
    for s in range(3):
        for layer in (1, 2):
            b = _batch(s, "a", [2 * s, 2 * s + 1])
            b.header.layer = layer
            sink.on_batch(Batch(header=b.header, tensor=b.tensor * layer + 50 * layer, seq=s))
    sink.close()
    run = ActivationRun(out)
    assert len(run.manifest["bases"]) == 2
    whole = run.dataset().to_table().sort_by([("layer", "ascending"), ("position", "ascending")])
    per_layer = torch.cat([run.request_rows("a", layer)[1] for layer in (1, 2)])
    assert torch.allclose(run.decode(whole), per_layer)
    assert torch.allclose(run.decode(whole.to_batches()[0].slice(0, 2)), per_layer[:2])


def test_request_of_a_layer_not_stored_is_named(tmp_path):
    sink = FsSink(tmp_path / "run")
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1]))
    sink.close()
    named = r"no committed shards for layer 5 .*'L1.post_block'"
    with pytest.raises(FileNotFoundError, match=named):
        ActivationRun(tmp_path / "run").request("a", layer=5)


def test_replay_of_hooks_not_stored_is_named(tmp_path):
    import subprocess
    import sys

    from tests.support.procs import ROOT

    sink = FsSink(tmp_path / "run")
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1]))
    sink.close()
    r = subprocess.run(
        [sys.executable, "-m", "actbus.cli", "replay", str(tmp_path / "run"), "--publish",
         f"ipc://{tmp_path}/r.sock", "--hooks", "mlp_out", "--wait-s", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and "--hooks ('mlp_out',)" in r.stderr, r.stderr
    assert "the run has streams ['L1.post_block']" in r.stderr, r.stderr


def test_rotation_by_size(tmp_path):
    """--shard-mb: a shard closes once its rows' bytes reach the limit."""
    one = 2 * 8 * 4  # the activation bytes of one 2-row message; its row columns add more
    sink = FsSink(str(tmp_path / "run"), WriterConfig(shard_bytes=3 * one, flush_s=60))
    sink.on_welcome(INFO)
    for s in range(6):
        sink.on_batch(_batch(s, "a", [2 * s, 2 * s + 1]))
    sink.writer._commits.join()
    committed = [s["rows"] for s in ActivationRun(tmp_path / "run").manifest["shards"]]
    assert committed and max(committed) < 6 * 2  # rotated before the end, by bytes alone
    sink.close()
    assert ActivationRun(tmp_path / "run").manifest["total_rows"] == 12


def test_restart_removes_its_own_tmp_files_only(tmp_path):
    out = tmp_path / "run"
    sink = FsSink(out)
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1]))
    sink.close()
    half = out / "L1.post_block" / "shard-000003.arrow.tmp"  # a crash mid-write
    half.write_bytes(b"half")
    (out / "manifest.json.tmp").write_bytes(b"half")
    theirs = out / "notes" / "draft.tmp"  # not the sink's
    theirs.parent.mkdir()
    theirs.write_text("keep me")
    FsSink(out).close()
    assert not half.exists() and not (out / "manifest.json.tmp").exists()
    assert theirs.read_text() == "keep me"


def test_a_layer_read_without_its_hook_never_mixes_hooks(tmp_path):
    """``dataset(layer)`` and ``request(id, layer)`` agree: the layer's one stored hook,
    or an error naming the hooks when it has several (``dataset(layer)`` mixed them;
    ``request`` took post_block, even in a run without it). A request with no rows
    there raises (it was an empty tensor)."""
    import dataclasses

    def at(batch: Batch, hook: str) -> Batch:
        return dataclasses.replace(batch, header=dataclasses.replace(batch.header, hook=hook))

    sink = FsSink(tmp_path / "one")
    sink.on_welcome(INFO)
    sink.on_batch(at(_batch(0, "a", [0, 1]), "mlp_out"))
    sink.close()
    one = ActivationRun(tmp_path / "one")
    assert one.request("a", 1).shape == (2, 8) and one.dataset(1).count_rows() == 2
    with pytest.raises(KeyError, match=r"request 'nobody' has no rows at layer 1 hook 'mlp_out'"):
        one.request("nobody", 1)

    sink = FsSink(tmp_path / "two")
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", [0, 1]))
    sink.on_batch(at(_batch(0, "a", [0, 1, 2]), "mlp_out"))
    sink.close()
    two = ActivationRun(tmp_path / "two")
    hooks = r"layer 1 is stored with hooks \['mlp_out', 'post_block'\]; name one"
    for read in (lambda: two.dataset(1), lambda: two.request("a", 1)):
        with pytest.raises(ValueError, match=hooks):
            read()
    assert two.dataset(1, "post_block").count_rows() == 2 and two.dataset().count_rows() == 5
    assert two.request("a", 1, "mlp_out").shape == (3, 8)
    assert two.request_ids(1) == ["a"]  # ids, not rows: any hook
