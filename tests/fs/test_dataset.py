"""Reading a stored run: TokenDataset (workers x ranks, shuffle, seeding) and HF datasets."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from actbus.bus import Batch
from actbus.wire import Header, RowIndex
from consumers.fs import ActivationRun, FsSink, WriterConfig
from consumers.fs.torch_dataset import TokenDataset

HIDDEN = 8
INFO = {"model": "m", "hidden_size": HIDDEN, "dtype": "float32"}


def _batch(step: int, reqs: list[tuple[str, int]], tags=None) -> Batch:
    """Requests ``(id, n_rows)``; each row's values encode (step, position)."""
    offsets = np.cumsum([0] + [n for _, n in reqs])
    positions = np.concatenate([np.arange(step * 100, step * 100 + n) for _, n in reqs])
    ri = RowIndex(
        [r for r, _ in reqs], offsets, positions, positions + 7, tags=tags or [{} for _ in reqs]
    )
    n = int(offsets[-1])
    h = Header(step, 1, "post_block", "float32", (n, HIDDEN), "m", ri)
    t = torch.from_numpy(positions).float()[:, None] + torch.arange(HIDDEN) / 100
    return Batch(header=h, tensor=t.contiguous(), seq=step)


def _make_run(path, steps: int = 30, ipc: str = "file", shard_rows: int = 50) -> int:
    sink = FsSink(str(path), WriterConfig(shard_rows=shard_rows, ipc=ipc))
    sink.on_welcome(INFO)
    rows = 0
    for s in range(steps):
        reqs = [(f"r{s % 4}", 3 + s % 5), (f"q{s % 3}", 2)]
        sink.on_batch(_batch(s, reqs, tags=[{"split": "train", "s": s}, {}]))
        rows += sum(n for _, n in reqs)
    sink.close()
    return rows


def _rows_of(loader) -> list[tuple[str, int]]:
    out = []
    for b in loader:
        assert b["activation"].shape == (len(b["request_id"]), HIDDEN)
        # each row's values were made from its position: the columns stayed aligned
        assert torch.equal(b["activation"][:, 0], b["position"].float())
        out.extend(zip(b["request_id"], b["position"].tolist(), strict=True))
    return out


def test_every_row_exactly_once_across_2_workers_x_2_ranks(tmp_path):
    total = _make_run(tmp_path / "run")
    run = ActivationRun(tmp_path / "run")
    assert len(run.shards()) >= 4
    seen = []
    per_rank = []
    for rank in range(2):
        ds = TokenDataset(
            tmp_path / "run",
            1,
            batch_tokens=16,
            shuffle_buffer=40,
            seed=3,
            rank=rank,
            world_size=2,
            unit_rows=16,
        )
        ds.set_epoch(1)
        got = _rows_of(DataLoader(ds, batch_size=None, num_workers=2))
        per_rank.append(len(got))
        seen.extend(got)
    assert len(seen) == total and len(set(seen)) == total  # all of them, none twice
    assert min(per_rank) > 0.3 * total  # both ranks did real work


def test_same_seed_and_epoch_same_batches_other_epoch_other_order(tmp_path):
    _make_run(tmp_path / "run")

    def order(epoch: int, seed: int = 0) -> list[tuple[str, int]]:
        ds = TokenDataset(tmp_path / "run", 1, batch_tokens=8, shuffle_buffer=32, seed=seed)
        ds.set_epoch(epoch)
        return _rows_of(ds)

    a = order(0)
    assert a == order(0)
    assert sorted(a) == sorted(order(1)) and a != order(1)
    assert a != order(0, seed=1)
    unshuffled = TokenDataset(tmp_path / "run", 1, batch_tokens=8, shuffle_buffer=0)
    assert a != _rows_of(unshuffled) and sorted(a) == sorted(_rows_of(unshuffled))


def test_set_epoch_reaches_persistent_workers(tmp_path):
    """Persistent workers keep their own dataset copy; the epoch must reach them."""
    total = _make_run(tmp_path / "run")
    ds = TokenDataset(tmp_path / "run", 1, batch_tokens=8, shuffle_buffer=32, seed=0)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append(_rows_of(loader))
    assert all(len(set(e)) == len(e) == total for e in epochs)
    assert epochs[0] != epochs[1]


def test_extra_columns_and_bad_column_named(tmp_path):
    _make_run(tmp_path / "run", steps=5)
    ds = TokenDataset(tmp_path / "run", 1, batch_tokens=4, columns=("tags", "step"))
    b = next(iter(ds))
    assert isinstance(b["step"], torch.Tensor) and isinstance(b["tags"][0], str)
    assert all(isinstance(json.loads(t), dict) for t in b["tags"])
    with pytest.raises(ValueError, match=r"columns: \['nope'\] not in the run's shards"):
        TokenDataset(tmp_path / "run", 1, columns=("nope",))
    with pytest.raises(ValueError, match="no committed rows for layer 2"):
        TokenDataset(tmp_path / "run", 2)


def test_drop_last_and_batch_sizes(tmp_path):
    total = _make_run(tmp_path / "run", steps=7)
    sizes = [len(b["request_id"]) for b in TokenDataset(tmp_path / "run", 1, batch_tokens=10)]
    assert sum(sizes) == total and all(s == 10 for s in sizes[:-1])
    kept = TokenDataset(tmp_path / "run", 1, batch_tokens=10, drop_last=True)
    assert [len(b["request_id"]) for b in kept] == [10] * (total // 10)


def test_hf_datasets_load_shards(tmp_path):
    """``load_dataset("arrow")`` reads the default IPC file shards;
    ``Dataset.from_file`` (it memory-maps the IPC stream format) reads --ipc stream."""
    _make_run(tmp_path / "file", steps=6)
    _make_run(tmp_path / "stream", steps=6, ipc="stream")
    shards = ActivationRun(tmp_path / "file").shards()
    d = datasets.load_dataset(
        "arrow", data_files=[str(p) for p in shards], split="train", cache_dir=str(tmp_path / "c")
    )
    assert d.num_rows == ActivationRun(tmp_path / "file").manifest["total_rows"]
    assert d.features["activation"].length == HIDDEN
    stream_run = ActivationRun(tmp_path / "stream")
    first = stream_run.shards()[0]
    hf = datasets.Dataset.from_file(str(first))
    ref = stream_run.read(first)
    assert hf.num_rows == ref.num_rows
    x = hf.with_format("torch")["activation"][:]
    assert torch.equal(x, stream_run.decode(ref))
    assert Counter(hf["request_id"]) == Counter(ref.column("request_id").to_pylist())
    # the stream run reads like the file run through ActivationRun
    a = ActivationRun(tmp_path / "file").request_rows("r1", 1)
    b = stream_run.request_rows("r1", 1)
    assert np.array_equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bf16_rows_read_through_hf_datasets_decode_with_the_documented_line(tmp_path):
    """bfloat16 is stored as its uint16 bits (Arrow has no bfloat16); docs/fs-sink.md's
    one line turns what ``datasets`` returns back into the exact tensor."""
    sink = FsSink(str(tmp_path / "run"))
    sink.on_welcome({**INFO, "dtype": "bfloat16"})
    b = _batch(0, [("r", 5)])
    x = b.tensor.to(torch.bfloat16)
    sink.on_batch(Batch(header=dataclasses.replace(b.header, dtype="bfloat16"), tensor=x, seq=0))
    sink.close()
    shards = [str(p) for p in ActivationRun(tmp_path / "run").shards()]
    ds = datasets.load_dataset("arrow", data_files=shards, split="train", cache_dir=str(tmp_path))
    assert ds.features["activation"].feature.dtype == "uint16"
    acts = torch.tensor(np.array(ds["activation"], dtype=np.uint16)).view(torch.bfloat16)
    assert torch.equal(acts, x)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "fs-sink.md").read_text()
    assert 'torch.tensor(np.array(ds["activation"], dtype=np.uint16)).view(torch.bfloat16)' in doc
