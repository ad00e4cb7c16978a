"""A stored run as a PyTorch ``IterableDataset`` of token batches.

Work is split into units: row ranges of at most ``unit_rows`` rows of one shard,
computed from the manifest alone, so every DataLoader worker on every rank derives
the same list without talking to the others. Each epoch the shards are put in a
seeded order (the same on every consumer), their units laid end to end, and the
list cut into ``world_size * num_workers`` contiguous, near-equal parts: consumer
``rank * num_workers + worker`` reads its part (mostly whole shards, so a
compressed shard is decompressed about once). Every committed row is therefore
yielded exactly once per epoch across all consumers.

With ``match``, only rows of requests whose stored tags match are kept, by the rule
a live subscription's ``--match`` follows at the publisher (``Subscription``), so a
stored run filters as the stream it came from would have.

Rows then pass a shuffle buffer of ``shuffle_buffer`` rows (0: file order),
seeded by ``(seed, epoch, consumer)``: the same seed and epoch give the same
batches. Call ``set_epoch`` before each epoch, as with ``DistributedSampler``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from consumers.fs.reader import ActivationRun

MATCH_CACHE = 1 << 16
"""Verdicts kept per distinct tags text (requests repeat theirs on every row)."""
_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)


def _seed(*parts: int) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TokenDataset(IterableDataset):
    """Token batches of one (layer, hook) of a run: dicts with ``activation``
    ``[b, width]`` (decoded from any reduction), ``request_id`` (list of str),
    ``position`` (LongTensor ``[b]``) and every column named in ``columns``
    (numeric ones as tensors, others, e.g. ``tags`` JSON strings, as lists).
    ``match`` (``{"split": "train"}``, a list value accepting any of its values)
    keeps only the rows of requests whose tags match, as ``--match`` does live
    (``count_rows`` counts them; ``num_rows`` counts the rows before it).

    Use with ``DataLoader(ds, batch_size=None, num_workers=N)``: batching is done
    here. ``rank``/``world_size`` default to ``torch.distributed``'s when it is
    initialized, else 0/1.
    """

    def __init__(
        self,
        run: str | Path,
        layer: int,
        hook: str = "post_block",
        *,
        batch_tokens: int = 4096,
        shuffle_buffer: int = 65536,
        seed: int = 0,
        columns: tuple[str, ...] = (),
        rank: int | None = None,
        world_size: int | None = None,
        unit_rows: int = 8192,
        drop_last: bool = False,
        skip_bad: bool = False,
        match: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0 (0: no shuffle), got {shuffle_buffer}")
        if unit_rows < 1:
            raise ValueError(f"unit_rows must be >= 1, got {unit_rows}")
        self.run = ActivationRun(run, skip_bad=skip_bad)
        self.layer = layer
        self.hook = hook
        self.batch_tokens = batch_tokens
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.columns = tuple(columns)
        self.unit_rows = unit_rows
        self.drop_last = drop_last
        self.match = TagMatch(match) if match else None
        # Shared memory, so persistent DataLoader workers (which keep their own copy
        # of the dataset) still see set_epoch.
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if world_size is None and dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        self.rank = rank or 0
        self.world_size = world_size or 1
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.entries = self.run.shard_entries(layer, hook)
        if not self.entries:
            have = sorted(self.run.manifest.get("rows", {}))
            raise ValueError(
                f"{self.run.path}: no committed rows for layer {layer} hook {hook!r}; "
                f"the run has {have}"
            )
        schema = self.run.read(self.run.path / self.entries[0]["path"]).schema
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise ValueError(
                f"columns: {missing} not in the run's shards; available: {schema.names}"
            )
        self._numeric = {c: any(f(schema.field(c).type) for f in _NUMERIC) for c in self.columns}

    @property
    def num_rows(self) -> int:
        """Rows per epoch over all ranks and workers, before ``match``."""
        return sum(int(e["rows"]) for e in self.entries)

    def count_rows(self) -> int:
        """Rows per epoch over all ranks and workers, after ``match`` (which reads each
        shard's ``tags`` column once)."""
        if self.match is None:
            return self.num_rows
        n = 0
        for e in self.entries:
            tags = self.run.read(self.run.path / e["path"]).column("tags").to_pylist()
            n += int(self.match.rows(tags).sum())
        return n

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch; reaches DataLoader workers, persistent ones too."""
        self._epoch.value = epoch

    # ------------------------------------------------------------ partitioning
    def units(self, consumer: int, consumers: int) -> list[tuple[int, int, int]]:
        """``(shard entry, start row, stop row)`` read by ``consumer`` this epoch."""
        g = torch.Generator().manual_seed(_seed(self.seed, self.epoch))
        order = torch.randperm(len(self.entries), generator=g).tolist()
        all_units = [
            (i, start, min(start + self.unit_rows, int(self.entries[i]["rows"])))
            for i in order
            for start in range(0, int(self.entries[i]["rows"]), self.unit_rows)
        ]
        n = len(all_units)
        return all_units[consumer * n // consumers : (consumer + 1) * n // consumers]

    def _consumer(self) -> tuple[int, int]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    # ----------------------------------------------------------------- reading
    def _chunks(self, units: list[tuple[int, int, int]]) -> Iterator[dict[str, Any]]:
        cached: tuple[int, pa.Table] | None = None
        for i, start, stop in units:
            if cached is None or cached[0] != i:
                cached = (i, self.run.read(self.run.path / self.entries[i]["path"]))
            t = cached[1].slice(start, stop - start)
            if self.match is not None:
                t = t.filter(pa.array(self.match.rows(t.column("tags").to_pylist())))
                if not t.num_rows:
                    continue
            chunk: dict[str, Any] = {
                "activation": self.run.decode(t),
                "request_id": t.column("request_id").to_pylist(),
                "position": torch.from_numpy(t.column("position").to_numpy().copy()),
            }
            for c in self.columns:
                col = t.column(c)
                chunk[c] = (
                    torch.from_numpy(col.to_numpy().copy()) if self._numeric[c] else col.to_pylist()
                )
            yield chunk

    def __iter__(self) -> Iterator[dict[str, Any]]:
        consumer, consumers = self._consumer()
        g = torch.Generator().manual_seed(_seed(self.seed, self.epoch, consumer))
        pool: list[dict[str, Any]] = []
        held = 0
        keep = self.shuffle_buffer
        high = keep + max(keep, self.batch_tokens)  # refill threshold: copies stay ~2 per row
        for chunk in self._chunks(self.units(consumer, consumers)):
            pool.append(chunk)
            held += len(chunk["request_id"])
            if held >= high:
                merged = _shuffled(_concat(pool), g if keep else None)
                n_out = (held - keep) // self.batch_tokens * self.batch_tokens
                yield from _batches(_take(merged, 0, n_out), self.batch_tokens)
                pool, held = [_take(merged, n_out, held)], held - n_out
        if held:
            merged = _shuffled(_concat(pool), g if keep else None)
            for batch in _batches(merged, self.batch_tokens):
                if len(batch["request_id"]) == self.batch_tokens or not self.drop_last:
                    yield batch


class TagMatch:
    """Which stored rows a ``--match`` filter keeps: the rule of a live subscription
    (``Subscription.wants_request``), applied to each row's stored ``tags`` JSON."""

    def __init__(self, match: dict[str, Any]) -> None:
        from actbus.bus.protocol import Subscription
        from actbus.wire import SCHEMA_VERSION, WireError

        try:  # the HELLO form: the filter is checked as the publisher checks it
            self._sub = Subscription.from_wire({"schema": SCHEMA_VERSION, "tags": dict(match)})
        except (WireError, TypeError, ValueError) as e:
            raise ValueError(f"match: {e}") from None
        self._verdicts: dict[str | None, bool] = {}

    def wants(self, tags_json: str | None) -> bool:
        """Whether a row whose request's tags are ``tags_json`` is kept."""
        verdict = self._verdicts.get(tags_json)
        if verdict is None:
            tags = json.loads(tags_json) if tags_json else {}
            verdict = self._sub.wants_request(tags if isinstance(tags, dict) else {})
            if len(self._verdicts) >= MATCH_CACHE:
                self._verdicts.clear()
            self._verdicts[tags_json] = verdict
        return verdict

    def rows(self, tags_json: list[str | None]) -> np.ndarray:
        """A bool mask over rows: those kept."""
        return np.fromiter((self.wants(t) for t in tags_json), dtype=bool, count=len(tags_json))


def _concat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    if len(chunks) == 1:
        return chunks[0]
    out = {}
    for k, v in chunks[0].items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.cat([c[k] for c in chunks])
        else:
            out[k] = [x for c in chunks for x in c[k]]
    return out


def _take(d: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] for k, v in d.items()}


def _shuffled(d: dict[str, Any], g: torch.Generator | None) -> dict[str, Any]:
    if g is None:
        return d
    n = len(d["request_id"])
    perm = torch.randperm(n, generator=g)
    idx = perm.tolist()
    return {
        k: v[perm] if isinstance(v, torch.Tensor) else [v[i] for i in idx] for k, v in d.items()
    }


def _batches(d: dict[str, Any], size: int) -> Iterator[dict[str, Any]]:
    n = len(d["request_id"])
    for start in range(0, n, size):
        yield _take(d, start, min(start + size, n))
