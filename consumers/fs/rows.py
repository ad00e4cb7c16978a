"""The rows of one tap at one step as the sink handles them: per-row metadata plus
the tensor. Cut from a bus ``Batch`` (the request table expanded per row by the
wire's ``RowIndex.per_row``); sliced by the store filter and by request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actbus.bus import Batch


@dataclass
class TapRows:
    """Rows of one (step, layer, hook), each with its request's fields."""

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
    def from_batch(cls, batch: Batch) -> TapRows:
        h = batch.header
        ri = h.rows
        return cls(
            step=h.step,
            layer=h.layer,
            hook=h.hook,
            dtype=h.dtype,
            request_ids=ri.row_request_ids(),
            sample_index=ri.row_sample_index(),
            positions=np.asarray(ri.positions, dtype=np.int64),
            token_ids=np.asarray(ri.token_ids, dtype=np.int64),
            tags=ri.row_tags(),
            # Buffered for up to --flush-s and encoded zero-copy: never a view of the
            # publisher's shared memory, which would hold back the sink's credit.
            tensor=batch.keep(),
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def take(self, idx: np.ndarray) -> TapRows:
        """The rows at ``idx`` (int indices, in order); the tensor is copied."""
        il = idx.tolist()
        return TapRows(
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
