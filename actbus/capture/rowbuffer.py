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

A ``TapRows`` made ``over`` a region of a ``Slab`` (one large allocation shared by
many requests' buffers, from a ``SlabPool``) lets the collector write the single rows
of a decode step, for every request in a message, with one numpy scatter per slab
instead of a Python call per request: that per-request work holds the GIL, which the
front end's output processing waits for (numpy lets go of it to copy). A buffer leaves its slab
(``home`` becomes None) when it first grows or is sorted. A slab's memory is freed
when no buffer and no handed-out view refers to it: a view held keeps its slab's rows
(at most ``SLAB_BYTES`` of them, written pages only) alive. Once most of a full slab's
requests are collected, the few left move out (``retire``), so a long request does not
keep its neighbours' rows.

Fresh memory costs the kernel a page fault per 4 KiB page at its first write, which
made writing returned rows several times slower than copying them. So a pool keeps
one spare slab per row size whose pages a thread of its own faults in ahead of use
(``madvise(MADV_POPULATE_WRITE)``, which never changes what a page holds, and runs
without the GIL): the receiving thread writes into memory that is already there. The
spare (``SLAB_BYTES``) stays resident while rows are being returned, and goes with
the pool's slabs when the front end is idle.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import sys
import threading
import weakref

import numpy as np
import torch

log = logging.getLogger("actbus.rowbuffer")

MIN_CAPACITY = 16
SLAB_BYTES = 256 << 20
"""Rows of many requests share one allocation of about this size (pages are touched
only where rows are written): larger, fewer scatters per message; smaller, less memory
kept by a view held after its neighbours' requests ended."""


class Slab:
    """One allocation of rows (raw bytes), their positions and token ids."""

    __slots__ = ("__weakref__", "buffers", "items", "memory", "pos", "rows", "tok", "used")

    def __init__(self, rows: int, row_bytes: int) -> None:
        self.pos = np.empty(rows, dtype=np.int64)
        self.tok = np.empty(rows, dtype=np.int64)
        # An anonymous mapping, not numpy's allocator: numpy asks large allocations
        # for huge pages, whose first touch cost the kernel twice the small pages' time.
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self.memory = mmap.mmap(-1, max(rows * row_bytes, 1), flags=private)
        """Unmapped once nothing refers to it: no buffer, no view handed out."""
        self.rows = np.frombuffer(self.memory, dtype=np.uint8, count=rows * row_bytes).reshape(
            rows, row_bytes
        )
        self.items = self.rows.view(f"V{row_bytes}").reshape(rows)
        """The rows as one item each, for scatters."""
        self.used = 0
        self.buffers: set[TapRows] = set()
        """Buffers with rows here whose requests have not been collected."""

    def sparse(self) -> bool:
        """Its live buffers hold room for under a quarter of its rows: the rest is kept
        only by views (or nothing)."""
        return 4 * sum(len(t._pos) for t in self.buffers) < len(self.pos)


class SlabPool:
    """Hands out regions of slabs, one slab being filled per row size; a full slab is
    forgotten here and lives on as long as its buffers or views do. With ``prefault``
    (where the kernel can), the next slab of each row size is faulted in ahead."""

    def __init__(self, slab_bytes: int | None = None, prefault: bool = True) -> None:
        self.slab_bytes = slab_bytes or SLAB_BYTES
        self._filling: dict[int, Slab] = {}
        self._spare: dict[int, Slab] = {}
        self.prefault = prefault and _Populator.works()

    def take(self, rows: int, row_bytes: int) -> tuple[Slab, int]:
        """A region of ``rows`` rows of ``row_bytes``: its slab and first row."""
        slab = self._filling.get(row_bytes)
        if slab is None or slab.used + rows > len(slab.pos):
            slab = self._next(rows, row_bytes)
            self._filling[row_bytes] = slab
        base = slab.used
        slab.used += rows
        return slab, base

    def _next(self, rows: int, row_bytes: int) -> Slab:
        usual = max(self.slab_bytes // max(row_bytes, 1), 1)
        spare = self._spare.get(row_bytes)
        if spare is not None and len(spare.pos) >= rows:
            slab = self._spare.pop(row_bytes)
        else:  # the first of its size (or an outsized one): faulted in as it is written
            slab = Slab(max(usual, rows), row_bytes)
        if self.prefault and row_bytes not in self._spare:  # an unused spare is kept
            self._spare[row_bytes] = nxt = Slab(usual, row_bytes)
            _Populator.submit(nxt)
        return slab

    def release(self) -> None:
        """Fill no slab further: each is freed once its buffers and views are gone
        (and keep no spare)."""
        self._filling.clear()
        self._spare.clear()

    def filling(self, slab: Slab) -> bool:
        return self._filling.get(slab.rows.shape[1]) is slab


def retire(buffers: list[TapRows], pool: SlabPool) -> None:
    """The buffers of collected requests leave their slabs' accounts; a slab left
    sparse moves its survivors' rows not handed out into memory of their own, so one
    long request keeps no more than its own rows (and views held keep theirs)."""
    touched = set()
    for t in buffers:
        if t.home is not None:
            t.home[0].buffers.discard(t)
            touched.add(t.home[0])
    for slab in touched:
        if not pool.filling(slab) and slab.sparse():
            for t in list(slab.buffers):
                t._move(len(t._pos))


class TapRows:
    """Rows ``start .. end`` are held and not handed out yet (DELTA outputs move
    ``start``); rows before ``start`` were handed out, ``released`` of them let go."""

    __slots__ = (
        "_pos", "_rows", "_tok", "dtype", "end", "home", "last", "released", "start", "width"
    )  # fmt: skip

    def __init__(self, row_bytes: int, dtype: torch.dtype, width: int, capacity: int) -> None:
        cap = max(capacity, MIN_CAPACITY)
        self.dtype = dtype
        self.width = width
        self._pos = np.empty(cap, dtype=np.int64)
        self._tok = np.empty(cap, dtype=np.int64)
        self._rows = np.empty((cap, row_bytes), dtype=np.uint8)
        self.start = 0
        self.end = 0
        self.released = 0
        self.last = -1  # the position of row ``end - 1``
        self.home: tuple[Slab, int, int] | None = None
        """The slab, the first row there and the rows held, while they live in a slab."""

    @classmethod
    def over(
        cls, pool: SlabPool, row_bytes: int, dtype: torch.dtype, width: int, capacity: int
    ) -> TapRows:
        """Rows in a region of one of ``pool``'s slabs."""
        t = cls.__new__(cls)
        cap = max(capacity, MIN_CAPACITY)
        slab, base = pool.take(cap, row_bytes)
        t.dtype, t.width = dtype, width
        t._pos = slab.pos[base : base + cap]
        t._tok = slab.tok[base : base + cap]
        t._rows = slab.rows[base : base + cap]
        t.start = t.end = t.released = 0
        t.last = -1
        t.home = (slab, base, cap)
        slab.buffers.add(t)
        return t

    def append(self, positions: np.ndarray, token_ids: np.ndarray, rows: np.ndarray) -> None:
        """``positions``, ``token_ids``: int64 ``[k]``; ``rows``: uint8 ``[k, row_bytes]``."""
        k = len(positions)
        if k == 0:
            return
        end = self.end
        if end + k > len(self._pos):
            self._move(max(2 * (end - self.start + k), MIN_CAPACITY))
            end = self.end
        self._pos[end : end + k] = positions
        self._tok[end : end + k] = token_ids
        self._rows[end : end + k] = rows
        self.end = end + k
        first, self.last = int(positions[0]), int(positions[-1])
        if (end > self.start and first < self._pos[end - 1]) or (
            k > 1 and bool((positions[1:] < positions[:-1]).any())
        ):
            self._move(len(self._pos), sort=True)

    def append_one(self, position: int, token_id: int, row: np.ndarray) -> None:
        """One row (a decode step's): scalar writes, a third of ``append``'s cost."""
        end = self.end
        if end == len(self._pos):
            self._move(max(2 * (end - self.start + 1), MIN_CAPACITY))
            end = self.end
        self._pos[end] = position
        self._tok[end] = token_id
        self._rows[end] = row
        self.end = end + 1
        out_of_order = end > self.start and position < self.last
        self.last = position
        if out_of_order:
            self._move(len(self._pos), sort=True)

    def _move(self, capacity: int, sort: bool = False) -> None:
        """Rows not handed out into new memory (stably sorted by position if ``sort``)."""
        live = slice(self.start, self.end)
        n = self.end - self.start
        pos = np.empty(capacity, dtype=np.int64)
        tok = np.empty(capacity, dtype=np.int64)
        rows = np.empty((capacity, self._rows.shape[1]), dtype=np.uint8)
        if sort:
            order = np.argsort(self._pos[live], kind="stable")
            np.take(self._pos[live], order, out=pos[:n])
            np.take(self._tok[live], order, out=tok[:n])
            np.take(self._rows[live], order, axis=0, out=rows[:n])
        else:
            pos[:n], tok[:n], rows[:n] = self._pos[live], self._tok[live], self._rows[live]
        self._pos, self._tok, self._rows = pos, tok, rows
        if self.home is not None:
            self.home[0].buffers.discard(self)
        self.home = None
        self.released += self.start
        self.start, self.end = 0, n
        if n:
            self.last = int(pos[n - 1])

    def below(self, limit: int) -> int:
        """Rows held (handed out or not) with position below ``limit``."""
        live = self._pos[self.start : self.end]
        return self.released + self.start + int(np.searchsorted(live, limit))

    def pending_below(self, limit: int) -> int:
        """Rows not handed out yet with position below ``limit``."""
        return int(np.searchsorted(self._pos[self.start : self.end], limit))

    def view(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``lo .. hi`` (buffer indices): positions, token ids, ``[n, width]`` rows;
        views, not copies."""
        rows = torch.from_numpy(self._rows[lo:hi]).view(self.dtype).view(hi - lo, self.width)
        return torch.from_numpy(self._pos[lo:hi]), torch.from_numpy(self._tok[lo:hi]), rows


class _Populator:
    """One thread per process that faults slabs' pages in ahead of their use."""

    _queue: queue.SimpleQueue[weakref.ref[Slab]] = queue.SimpleQueue()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()
    _works: bool | None = None
    _madvise = None
    MADV_POPULATE_WRITE = 23  # Linux 5.14+

    @classmethod
    def works(cls) -> bool:
        """Whether this kernel populates mappings on request (checked once)."""
        with cls._lock:
            if cls._works is None:
                cls._works = cls._probe()
            return cls._works

    @classmethod
    def _probe(cls) -> bool:
        if not sys.platform.startswith("linux"):
            return False
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            probe = Slab(1, mmap.PAGESIZE)
            if fn(probe.rows.ctypes.data, mmap.PAGESIZE, cls.MADV_POPULATE_WRITE) != 0:
                log.debug("madvise(MADV_POPULATE_WRITE) is not there: no prefaulting")
                return False
        except (OSError, AttributeError):
            return False
        cls._madvise = fn
        return True

    @classmethod
    def submit(cls, slab: Slab) -> None:
        with cls._lock:
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="actbus-prefault", daemon=True)
                cls._thread.start()
        cls._queue.put(weakref.ref(slab))  # a slab let go meanwhile is not kept for this

    @classmethod
    def _run(cls) -> None:
        while True:
            slab = cls._queue.get()()
            if slab is None:
                continue
            # ctypes lets go of the GIL for the call; the slab is held until it returns.
            cls._madvise(slab.rows.ctypes.data, slab.rows.nbytes, cls.MADV_POPULATE_WRITE)
            del slab
