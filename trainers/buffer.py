"""Token rows and the shuffle buffer that mixes them into training batches.

A live stream arrives in engine-step order: consecutive rows are neighbouring
tokens of the same few requests, so training on them as they come would bias every
step. Rows go into a fixed-size buffer per stream and batches are drawn from it at
random, each row handed out once.
"""

from __future__ import annotations

import hashlib
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
        activation: torch.Tensor, index: RowIndex, label_tags: tuple[str, ...]
    ) -> TrainingRows:
        """The rows of one bus message: its tensor and its row index, whose request
        fields (id, split, the ``label_tags`` values) are expanded per row."""
        n_req = len(index.request_ids)
        split = index.per_row(np.array([split_value(r) for r in index.request_ids]))
        if label_tags:
            per_req = np.array(
                [
                    [_as_float(index.request_tags(i).get(t)) for t in label_tags]
                    for i in range(n_req)
                ],
                dtype=np.float32,
            ).reshape(n_req, len(label_tags))
            label = torch.from_numpy(index.per_row(per_req))
        else:
            label = torch.full((index.num_rows, 0), float("nan"))
        return TrainingRows(
            activation,
            torch.as_tensor(np.asarray(index.positions, dtype=np.int64)),
            index.per_row(index.request_ids),
            torch.from_numpy(split).to(torch.float64),
            label,
        )


def _as_float(v: Any) -> float:
    if v is None:
        return float("nan")
    if isinstance(v, bool):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(
            f"label tag value {v!r} is not a number; tag requests with numeric labels "
            "(e.g. {'label': 1})"
        ) from None


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
