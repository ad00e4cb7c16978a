"""Token rows and the shuffle buffer that mixes them into training batches.

A live stream arrives in engine-step order: consecutive rows are neighbouring
tokens of the same few requests, so training on them as they come would bias every
step. Rows go into a fixed-size buffer per stream and batches are drawn from it at
random, each row handed out once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actbus.wire import RowIndex


def split_value(request_id: str) -> float:
    """A request's place in [0, 1): a stable hash, so train/held-out splits by request."""
    h = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


@dataclass
class TrainingRows:
    """Rows of one stream with what the trainers need to know about each."""

    activation: torch.Tensor  # [n, d]
    position: torch.Tensor  # int64 [n]
    request_id: np.ndarray  # object [n]
    split: torch.Tensor  # float64 [n], split_value of the row's request
    label: torch.Tensor  # float32 [n, n_labels], NaN where the request has no such tag

    def __len__(self) -> int:
        return int(self.activation.shape[0])

    def slice(self, a: int, b: int) -> TrainingRows:
        return TrainingRows(
            self.activation[a:b],
            self.position[a:b],
            self.request_id[a:b],
            self.split[a:b],
            self.label[a:b],
        )

    def take(self, idx: torch.Tensor) -> TrainingRows:
        """The rows at ``idx`` (int64 indices, in order)."""
        return TrainingRows(
            self.activation[idx],
            self.position[idx],
            self.request_id[idx.numpy()],
            self.split[idx],
            self.label[idx],
        )

    def as_batch(self) -> dict[str, Any]:
        return {
            "activation": self.activation,
            "position": self.position,
            "request_id": self.request_id.tolist(),
            "split": self.split,
            "label": self.label,
        }

    @staticmethod
    def from_message(
        activation: torch.Tensor, index: RowIndex, labels: torch.Tensor
    ) -> TrainingRows:
        """The rows of one bus message: its tensor and its row index, whose request
        fields (id, split) are expanded per row, and ``labels`` ``[requests, n_labels]``
        per request (``parse_labels``)."""
        split = index.per_row(np.array([split_value(r) for r in index.request_ids]))
        return TrainingRows(
            activation,
            # A copy: the decoded positions are read-only (shared between messages),
            # which torch.as_tensor would warn about.
            torch.tensor(np.asarray(index.positions), dtype=torch.int64),
            index.per_row(index.request_ids),
            torch.from_numpy(split).to(torch.float64),
            torch.from_numpy(index.per_row(labels.numpy())),
        )


def parse_labels(
    tags: Sequence[Mapping[str, Any] | None], label_tags: tuple[str, ...]
) -> tuple[torch.Tensor, list[int]]:
    """Labels ``[len(tags), len(label_tags)]`` (float32, NaN where a tag is absent) and
    the indices whose label tags are not all finite float32 numbers (e.g. ``'<img ...>'``
    or ``"1e39"`` from an HTTP request): their labels are NaN too, for the caller to
    count and skip."""
    out = torch.full((len(tags), len(label_tags)), float("nan"))
    bad: list[int] = []
    for i, t in enumerate(tags if label_tags else ()):
        if not t:
            continue
        if not isinstance(t, Mapping):
            bad.append(i)
            continue
        for j, name in enumerate(label_tags):
            v = _as_float(t.get(name))
            if v is None:
                bad.append(i)
                out[i] = float("nan")
                break
            out[i, j] = v
    return out, bad


LABEL_MAX = float(np.finfo(np.float32).max)
"""Labels are float32: a larger value (1e39, 1e308) would become an infinity there."""


def _as_float(v: Any) -> float | None:
    """The number a tag value holds (NaN when absent), or None when it is not a finite
    float32 (labels are float32: 1e308 is finite as a Python float, infinite there)."""
    if v is None:
        return float("nan")
    if isinstance(v, (int, float, str)):  # bool is an int; "1" a number
        try:
            f = float(v)
        except (ValueError, OverflowError):
            return None
        return f if math.isfinite(f) and abs(f) <= LABEL_MAX else None
    return None


class ShuffleBuffer:
    """A fixed-capacity pool of rows; ``take`` removes a uniformly random batch."""

    def __init__(
        self, capacity: int, d: int, dtype: torch.dtype, n_labels: int, seed: int = 0
    ) -> None:
        self.capacity = capacity
        self.x = torch.empty(capacity, d, dtype=dtype)
        self.position = torch.empty(capacity, dtype=torch.long)
        self.request_id = np.empty(capacity, dtype=object)
        self.split = torch.empty(capacity, dtype=torch.float64)
        self.label = torch.empty(capacity, n_labels)
        self.n = 0
        self._gen = torch.Generator().manual_seed(seed)

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def put(self, rows: TrainingRows) -> int:
        """Append as many rows as fit; returns how many."""
        m = min(len(rows), self.room)
        a, b = self.n, self.n + m
        self.x[a:b] = rows.activation[:m]
        self.position[a:b] = rows.position[:m]
        self.request_id[a:b] = rows.request_id[:m]
        self.split[a:b] = rows.split[:m]
        self.label[a:b] = rows.label[:m]
        self.n = b
        return m

    def take(self, count: int) -> TrainingRows:
        """Remove ``count`` random rows (all of them if fewer); the rest stay packed."""
        count = min(count, self.n)
        n = self.n
        pick = torch.randperm(n, generator=self._gen)[:count]
        out = TrainingRows(  # advanced indexing copies: the rows are the batch's own
            self.x[pick],
            self.position[pick],
            self.request_id[pick.numpy()],
            self.split[pick],
            self.label[pick],
        )
        # Move the rows of the tail that were not taken into the holes below it.
        keep_tail = torch.ones(count, dtype=torch.bool)
        tail_start = n - count
        in_tail = pick >= tail_start
        keep_tail[pick[in_tail] - tail_start] = False
        src = torch.arange(tail_start, n)[keep_tail]
        dst = pick[~in_tail]
        if len(dst):
            self.x[dst] = self.x[src]
            self.position[dst] = self.position[src]
            self.request_id[dst.numpy()] = self.request_id[src.numpy()]
            self.split[dst] = self.split[src]
            self.label[dst] = self.label[src]
        self.n = tail_start
        return out
