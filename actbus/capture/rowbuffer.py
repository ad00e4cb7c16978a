"""One request's returned rows at one tap, in position order, in memory of their own.

The front end's return collector copies each arriving piece of a request's rows
straight into its ``TapRows`` (numpy slice copies: no per-output concatenation, and
numpy lets go of the GIL for large ones) and hands out views of it: an output's
tensors are never assembled from pieces or copied again. The rows are kept as raw
bytes, so what is handed out is bitwise what the subscriber received, whatever the
dtype. Capacity is sized from the request's token budget and grows geometrically.
Growing (or restoring position order after a piece that arrived out of order) moves
the rows into new memory and copies only those not yet handed out: rows a DELTA
output took are let go then, while views already handed out keep the old memory.
"""

from __future__ import annotations

import numpy as np
import torch

MIN_CAPACITY = 16


class TapRows:
    """Rows ``start .. end`` are held and not handed out yet (DELTA outputs move
    ``start``); rows before ``start`` were handed out, ``released`` of them let go."""

    __slots__ = ("_meta", "_rows", "dtype", "end", "released", "start", "width")

    def __init__(self, row_bytes: int, dtype: torch.dtype, width: int, capacity: int) -> None:
        cap = max(capacity, MIN_CAPACITY)
        self.dtype = dtype
        self.width = width
        self._meta = np.empty((2, cap), dtype=np.int64)  # positions, token ids
        self._rows = np.empty((cap, row_bytes), dtype=np.uint8)
        self.start = 0
        self.end = 0
        self.released = 0

    def append(self, meta: np.ndarray, rows: np.ndarray) -> None:
        """``meta``: int64 ``[2, k]`` (positions, token ids); ``rows``: uint8 ``[k, row_bytes]``."""
        k = meta.shape[1]
        if k == 0:
            return
        end = self.end
        if end + k > self._meta.shape[1]:
            self._move(max(2 * (end - self.start + k), MIN_CAPACITY))
            end = self.end
        self._meta[:, end : end + k] = meta
        self._rows[end : end + k] = rows
        self.end = end + k
        pos = meta[0]
        if (end > self.start and pos[0] < self._meta[0, end - 1]) or (
            k > 1 and bool((pos[1:] < pos[:-1]).any())
        ):
            self._move(self._meta.shape[1], sort=True)

    def _move(self, capacity: int, sort: bool = False) -> None:
        """Rows not handed out into new memory (stably sorted by position if ``sort``)."""
        live = slice(self.start, self.end)
        n = self.end - self.start
        meta = np.empty((2, capacity), dtype=np.int64)
        rows = np.empty((capacity, self._rows.shape[1]), dtype=np.uint8)
        if sort:
            order = np.argsort(self._meta[0, live], kind="stable")
            np.take(self._meta[:, live], order, axis=1, out=meta[:, :n])
            np.take(self._rows[live], order, axis=0, out=rows[:n])
        else:
            meta[:, :n] = self._meta[:, live]
            rows[:n] = self._rows[live]
        self._meta, self._rows = meta, rows
        self.released += self.start
        self.start, self.end = 0, n

    def below(self, limit: int) -> int:
        """Rows held (handed out or not) with position below ``limit``."""
        live = self._meta[0, self.start : self.end]
        return self.released + self.start + int(np.searchsorted(live, limit))

    def pending_below(self, limit: int) -> int:
        """Rows not handed out yet with position below ``limit``."""
        return int(np.searchsorted(self._meta[0, self.start : self.end], limit))

    def view(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``lo .. hi`` (buffer indices): positions, token ids, ``[n, width]`` rows;
        views, not copies."""
        rows = torch.from_numpy(self._rows[lo:hi]).view(self.dtype).view(hi - lo, self.width)
        return (
            torch.from_numpy(self._meta[0, lo:hi]),
            torch.from_numpy(self._meta[1, lo:hi]),
            rows,
        )
