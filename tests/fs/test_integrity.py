"""The sink stays inside its run directory whatever its rows say; readers check a
run's shards on open; a storage error reports what the manifest on disk lists.

Real files, real batches handed to the sink in process (the same sink fed by a
hostile publisher over the bus is tests/fs/test_hostile_publisher.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from actbus.bus import Batch
from actbus.wire import Header, RowIndex
from consumers.fs import ActivationRun, BadShard, FsSink, StorageError
from consumers.fs.torch_dataset import TokenDataset

INFO = {"model": "m", "hidden_size": 8, "dtype": "float32"}


def _batch(step: int, rid: str, n: int, *, layer: int = 1, hook: str = "post_block") -> Batch:
    """Built directly, not decoded: what reaches the sink if the wire's checks are missed."""
    ri = RowIndex([rid], np.array([0, n]), np.arange(n), np.arange(n) + 10)
    h = Header(step, layer, hook, "float32", (n, 8), "m", ri)
    return Batch(header=h, tensor=torch.full((n, 8), float(step)), seq=step)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (symlinks not followed) with its size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def test_the_sink_never_writes_outside_its_run_whatever_the_rows_say(tmp_path, caplog):
    out = tmp_path / "work" / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sink = FsSink(out, shard_rows=2)
    sink.on_welcome(INFO)
    (out / "L2.post_block").symlink_to(elsewhere)  # a link planted inside the run
    old_layout = tmp_path / "old"
    (old_layout / "post_block").mkdir(parents=True)
    (out / "layer-03").symlink_to(old_layout)  # one where an older run's layout would be
    before = tree(tmp_path)
    sink.on_batch(_batch(0, "good", 2))
    with caplog.at_level(logging.ERROR, logger="actbus.fs_sink"):
        for bad in (
            _batch(1, "up", 2, hook="../../x"),
            _batch(2, "abs", 2, hook=str(tmp_path / "abs")),
            _batch(3, "neg", 2, layer=-1),
            _batch(4, "deep", 2, hook="post_block/../../../y"),
            _batch(5, "link", 2, layer=2),
            _batch(7, "old_link", 2, layer=3),
        ):
            sink.on_batch(bad)
    sink.on_batch(_batch(6, "good", 2))
    sink.close()
    after = tree(tmp_path)
    created = sorted(set(after) - set(before))
    assert all(p.startswith("work/run/") for p in created), created
    assert not list(elsewhere.iterdir()) and not (tmp_path / "abs").exists()
    assert not list((old_layout / "post_block").iterdir())
    changed = [p for p in before if not p.startswith("work/run") and after.get(p) != before[p]]
    assert changed == [], changed
    run = ActivationRun(out)
    assert run.manifest["counters"]["messages_refused_unsafe_path"] == 6
    assert run.manifest["counters"]["rows_refused_unsafe_path"] == 12
    assert run.manifest["hooks"] == ["post_block"] and run.manifest["layers"] == [1]
    steps = run.dataset(1).to_table(columns=["step"]).column("step").to_pylist()
    assert sorted(steps) == [0, 0, 6, 6]  # the good rows before and after
    assert run.verify() == []
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1 and "'../../x' is not a plain name" in logged[0], logged


def test_a_storage_error_counts_the_shards_the_manifest_on_disk_lists(tmp_path):
    out = tmp_path / "run"
    sink = FsSink(out, shard_rows=2)
    sink.on_welcome(INFO)
    sink.on_batch(_batch(0, "a", 2))
    sink.writer._commits.join()  # one shard committed and listed on disk
    (out / "manifest.json.tmp").mkdir()  # the next manifest update cannot be written
    sink.on_batch(_batch(1, "a", 2))
    with pytest.raises(StorageError) as err:
        sink.flush()
    sink.close()
    assert len(sink.manifest["shards"]) == 2  # memory lists the shard the disk does not
    assert "The 1 shards listed in" in str(err.value), err.value
    (out / "manifest.json.tmp").rmdir()
    assert len(ActivationRun(out).manifest["shards"]) == 1


def _run_of_three_shards(out: Path, ipc: str = "file") -> list[Path]:
    from consumers.fs import WriterConfig

    sink = FsSink(out, WriterConfig(shard_rows=4, ipc=ipc))
    sink.on_welcome(INFO)
    for step in range(3):
        sink.on_batch(_batch(step, f"r{step}", 4))
    sink.close()
    return ActivationRun(out).shards()


@pytest.mark.parametrize("ipc", ["file", "stream"])
def test_a_truncated_shard_is_named_on_open_and_can_be_skipped(tmp_path, caplog, ipc):
    out = tmp_path / "run"
    shards = _run_of_three_shards(out, ipc)
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    name = str(shards[1].relative_to(out))
    with pytest.raises(BadShard, match=rf"shard {name} has \d+ bytes, the manifest says"):
        ActivationRun(out)
    with caplog.at_level(logging.WARNING, logger="actbus.fs_reader"):
        run = ActivationRun(out, skip_bad=True)
    assert list(run.bad_shards) == [name]
    assert any(name in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    assert run.dataset(1).count_rows() == 8  # the two whole shards
    assert run.request_ids(1) == ["r0", "r2"]
    assert run.request_rows("r2", 1)[1].eq(2.0).all()
    assert any(p.startswith(f"{name}: ") for p in run.verify())  # verify still names it
    batches = list(TokenDataset(out, 1, shuffle_buffer=0, batch_tokens=64, skip_bad=True))
    assert sum(len(b["request_id"]) for b in batches) == 8


def test_a_shard_whose_framing_is_broken_is_caught_on_open_and_a_bit_flip_by_verify(tmp_path):
    out = tmp_path / "run"
    shards = _run_of_three_shards(out)
    data = bytearray(shards[0].read_bytes())
    data[-1] ^= 0xFF  # same size, footer magic broken
    shards[0].write_bytes(bytes(data))
    with pytest.raises(BadShard, match="not a whole Arrow IPC file"):
        ActivationRun(out)
    shards[0].write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))  # repaired
    data = bytearray(shards[2].read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside: the cheap check passes, verify does not
    shards[2].write_bytes(bytes(data))
    run = ActivationRun(out)
    assert run.verify() == [f"{shards[2].relative_to(out)}: checksum differs from the manifest"]
    shards[1].unlink()
    with pytest.raises(BadShard, match="is listed but missing"):
        ActivationRun(out)
