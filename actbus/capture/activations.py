"""What a request's returned rows are handed out as, and how many its tokens imply:
shared by the in-process collector (``returns``) and the child-process one
(``retproc``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actbus.capture.selection import Selection

CAPACITY_GUESS = 256
"""Generated tokens to make room for when a request sets no ``max_tokens``,"""
CAPACITY_CAP = 4096
"""and room for at most this many beyond its prompt at first (buffers grow past it)."""


@dataclass
class Activations:
    """One request's (one sample's) captured rows, in position order."""

    positions: torch.Tensor
    """int64 ``[n]``: token positions in the sequence (prompt first)."""
    token_ids: torch.Tensor
    """int64 ``[n]``: the token fed at each position."""
    tensors: dict[tuple[int, str], torch.Tensor]
    """``(layer, hook)`` -> ``[n, hidden]``, rows aligned with ``positions``."""
    complete: bool
    """Every row the selection implies for these tokens is here (final outputs)."""

    def __getitem__(self, key: tuple[int, str]) -> torch.Tensor:
        return self.tensors[key]

    @staticmethod
    def join(first: Activations | None, then: Activations) -> Activations:
        """Two consecutive DELTA pieces as one (vLLM merges outputs a slow reader
        has not taken yet)."""
        if first is None:
            return then
        return Activations(
            torch.cat([first.positions, then.positions]),
            torch.cat([first.token_ids, then.token_ids]),
            {k: torch.cat([first.tensors[k], t]) for k, t in then.tensors.items()},
            then.complete,
        )


def _expected_rows(sel: Selection, prompt_len: int, limit: int) -> int | None:
    """Rows per tap that positions ``0 .. limit-1`` give under ``sel`` (None: ``last``,
    whose one row comes with the request's end), by the worker's own row mask."""
    if sel.positions == "last":
        return None
    mask = sel.row_mask(np.arange(limit), prompt_len)
    return limit if mask is None else int(mask.sum())
