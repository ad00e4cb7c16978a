"""Rows of one (step, layer, hook) as the sink handles them: metadata per row, plus
the tensor. Cut from a bus ``Batch``; sliced by selection and by request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actbus.bus import Batch


@dataclass
class Rows:
    step: int
    layer: int
    hook: str
    dtype: str
    request_ids: list[str]  # per row
    sample_index: np.ndarray  # int32 [n]
    positions: np.ndarray  # int64 [n]
    token_ids: np.ndarray  # int64 [n]
    tags: list[dict[str, Any]]  # per row (the request's dict, shared, not copied)
    tensor: torch.Tensor  # [n, hidden]

    @classmethod
    def from_batch(cls, batch: Batch) -> Rows:
        h = batch.header
        ri = h.rows
        counts = np.diff(ri.offsets).astype(np.int64)
        n_req = len(ri.request_ids)
        tags: list[dict[str, Any]] = []
        for i, c in enumerate(counts):
            tags.extend([ri.request_tags(i)] * int(c))
        return cls(
            step=h.step,
            layer=h.layer,
            hook=h.hook,
            dtype=h.dtype,
            request_ids=ri.row_request_ids(),
            sample_index=np.repeat(
                np.array([ri.request_sample_index(i) for i in range(n_req)], dtype=np.int32),
                counts,
            ),
            positions=np.asarray(ri.positions, dtype=np.int64),
            token_ids=np.asarray(ri.token_ids, dtype=np.int64),
            tags=tags,
            tensor=batch.tensor,
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def take(self, idx: np.ndarray) -> Rows:
        """The rows at ``idx`` (int indices, in order); the tensor is copied."""
        il = idx.tolist()
        return Rows(
            self.step,
            self.layer,
            self.hook,
            self.dtype,
            [self.request_ids[i] for i in il],
            self.sample_index[idx],
            self.positions[idx],
            self.token_ids[idx],
            [self.tags[i] for i in il],
            self.tensor[torch.from_numpy(idx.astype(np.int64))],
        )

    def by_request(self) -> dict[tuple[str, int], np.ndarray]:
        """Row indices of each ``(request_id, sample_index)``, in row order."""
        out: dict[tuple[str, int], list[int]] = {}
        for i, (rid, si) in enumerate(
            zip(self.request_ids, self.sample_index.tolist(), strict=True)
        ):
            out.setdefault((rid, si), []).append(i)
        return {k: np.array(v, dtype=np.int64) for k, v in out.items()}

    def tags_json(self) -> list[str]:
        cache: dict[int, str] = {}
        out = []
        for t in self.tags:
            s = cache.get(id(t))
            if s is None:
                s = cache[id(t)] = json.dumps(t, sort_keys=True, separators=(",", ":"))
            out.append(s)
        return out
