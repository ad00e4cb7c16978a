"""Per-request rows, in position order, in slabs shared by many requests: handed out
as views.

The front end's collectors of returned rows (``actbus.capture.returns``: activations,
``width`` items of the model's dtype) and of returned scores (``actbus.monitor.returns``:
float32 scores, and the version of the weights that made each) keep each pending
request's rows here. A row is ``row_bytes`` raw bytes, so what is handed out is
bitwise what the subscriber received, whatever the dtype; each row also has a
position, a token id and any ``extra`` int64 columns a caller names. Arriving pieces
are numpy slice copies (no per-output concatenation, and numpy lets go of the GIL for
large ones) and outputs are views: never assembled from pieces or copied again.
Capacity is sized from the request's token budget and grows geometrically. Growing
(or restoring position order after a piece that arrived out of order) moves the rows
into new memory and copies only those not yet handed out: rows a DELTA output took
are let go then, while views already handed out keep the old memory. Regions are
handed out in order and never reused, so a view handed out stays valid.

Two ways to find a request's rows, for two ways of writing them:

- ``TapRows``, one object per request (the activations' way): a piece of many rows is
  a slice copy, and the collector notes the single rows of a decode step, for every
  request in a message, to write them with one numpy scatter per slab.
- ``SlotRows``, one stream's requests by slot in numpy arrays (the scores' way): a
  message's rows, for all of its requests, are written with one scatter per slab, and
  the per-message work does not grow with Python calls per request.

A ``TapRows`` made ``over`` a region of a ``Slab`` (one large allocation shared by
many requests' buffers, from a ``SlabPool``) leaves its slab (``home`` becomes None)
when it first grows or is sorted; a slot moves to a fresh region of its stream's slab
being filled. A slab's memory is freed when no buffer and no handed-out view refers
to it: a view held keeps its slab's rows (at most ``SLAB_BYTES`` of them, written
pages only) alive. Once the live regions of a slab that is no longer being filled
hold under a quarter of it (``Slab.sparse``), the few left move out (``retire``,
``SlotRows.compact``), so a long request does not keep its neighbours' rows.

Fresh memory costs the kernel a page fault per 4 KiB page at its first write, which
made writing returned rows several times slower than copying them. So a thread of
its own faults in the rows just past the regions a pool handed out, and at a slab's
end the next slab's first ones (``madvise(MADV_POPULATE_WRITE)``, which never changes
what a page holds, and runs without the GIL): the receiving thread writes into memory
that is already there. It runs as far ahead as the pool handed out since it was last
idle (at least ``PREFAULT_MIN``, at most a slab), and what it faulted in that no
buffer took is given back at idle: a few requests make about their own size resident,
not a slab. (A whole spare slab, 256 MiB, was faulted in for the first row returned: an
HTTP server limited to 20 MiB of rows, ``http_return_max_server_mb``, grew by 275 MiB.)
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import sys
import threading
import weakref
from typing import Any, ClassVar

import numpy as np
import torch

log = logging.getLogger("actbus.rowstore")

MIN_CAPACITY = 16
SLAB_BYTES = 256 << 20
"""Rows of many requests share one allocation of about this size (pages are touched
only where rows are written): larger, fewer scatters per message; smaller, less memory
kept by a view held after its neighbours' requests ended."""
PREFAULT_MIN = 16 << 20
"""Bytes a pool faults in ahead of its regions when it has handed out fewer since it
was idle."""


class Slab:
    """One allocation of rows (raw bytes), their positions, token ids and ``extra``
    int64 columns (read as attributes: ``slab.ver``); ``typed`` names a view of the
    rows as ``[rows, row_bytes / itemsize]`` of a dtype (``("val", np.float32)``)."""

    __slots__ = (
        "__weakref__", "buffers", "cols", "faulted", "items", "live", "memory", "pos", "rows",
        "tok", "used",
    )  # fmt: skip

    def __init__(
        self,
        rows: int,
        row_bytes: int,
        extra: tuple[str, ...] = (),
        typed: tuple[str, type] | None = None,
    ) -> None:
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
        self.items = as_items(self.rows)
        """The rows as one item each, for scatters."""
        self.cols = {name: np.empty(rows, dtype=np.int64) for name in extra}
        if typed is not None:
            self.cols[typed[0]] = self.rows.view(typed[1])
        self.used = 0
        self.faulted = 0
        """Rows up to here were asked to be faulted in ahead (those past ``used``)."""
        self.live = 0
        """Rows of the regions of requests not collected yet."""
        self.buffers: set[TapRows] = set()
        """``TapRows`` with rows here whose requests have not been collected."""

    def __getattr__(self, name: str) -> np.ndarray:
        if name == "cols":  # not set yet
            raise AttributeError(name)
        try:
            return self.cols[name]
        except KeyError:
            raise AttributeError(name) from None

    def sparse(self) -> bool:
        """Its live regions hold under a quarter of its rows: the rest is kept only by
        views (or nothing)."""
        return 4 * self.live < len(self.pos)

    def leave(self, t: TapRows) -> None:
        """``t``'s rows here no longer count as live (it moved out, or was collected)."""
        if t in self.buffers:
            self.buffers.discard(t)
            self.live -= t.home[2] if t.home is not None else 0


def as_items(rows: np.ndarray) -> np.ndarray:
    """Rows of bytes as one item each (numpy scatters whole items with one copy each,
    where bytes or words would go column by column)."""
    return rows.view(f"V{rows.shape[1]}").reshape(len(rows)) if rows.shape[1] else rows[:, :0]


class SlabPool:
    """Hands out regions of slabs, one slab being filled per row size; a full slab is
    forgotten here and lives on as long as its buffers or views do. With ``prefault``
    (where the kernel can), the rows past those handed out are faulted in ahead, as
    many bytes as were handed out since the pool was idle (``_ahead``). ``extra`` and
    ``typed``: the columns of its slabs (see ``Slab``)."""

    def __init__(
        self,
        slab_bytes: int | None = None,
        prefault: bool = True,
        extra: tuple[str, ...] = (),
        typed: tuple[str, type] | None = None,
    ) -> None:
        self.slab_bytes = slab_bytes or SLAB_BYTES
        self._filling: dict[int, Slab] = {}
        self._spare: dict[int, Slab] = {}
        self._columns = (extra, typed)
        self.prefault = prefault and _Populator.works()
        self._taken = 0
        """Bytes of regions handed out since the pool was idle (``release``)."""

    def take(self, rows: int, row_bytes: int) -> tuple[Slab, int]:
        """A region of ``rows`` rows of ``row_bytes``: its slab and first row."""
        slab = self._filling.get(row_bytes)
        if slab is None or slab.used + rows > len(slab.pos):
            slab = self._next(rows, row_bytes)
            self._filling[row_bytes] = slab
        base = slab.used
        slab.used += rows
        slab.live += rows
        self._taken += rows * row_bytes
        if self.prefault:
            self._ahead(slab, row_bytes)
        return slab, base

    def _next(self, rows: int, row_bytes: int) -> Slab:
        spare = self._spare.get(row_bytes)
        if spare is not None and len(spare.pos) >= rows:
            return self._spare.pop(row_bytes)
        return Slab(max(self._usual(row_bytes), rows), row_bytes, *self._columns)

    def _usual(self, row_bytes: int) -> int:
        return max(self.slab_bytes // max(row_bytes, 1), 1)

    def _ahead(self, slab: Slab, row_bytes: int) -> None:
        """Once under half a window is left faulted in past the regions handed out, fault
        in a window: as many bytes as were handed out since the pool was idle, at least
        ``PREFAULT_MIN`` and at most a slab; what passes the slab's end, at the start of
        the next one (kept as a spare). Rows about to be handed out are written into
        memory that is there, and what is resident ahead of use is bounded by use."""
        size = max(row_bytes, 1)
        window = min(max(self._taken, PREFAULT_MIN, size), max(self.slab_bytes, size)) // size
        if slab.faulted - slab.used > window // 2:
            return
        _fault(slab, slab.used + window)
        over = slab.used + window - len(slab.pos)
        if over > 0:
            spare = self._spare.get(row_bytes)
            if spare is None:
                spare = self._spare[row_bytes] = Slab(
                    self._usual(row_bytes), row_bytes, *self._columns
                )
            _fault(spare, over)

    def release(self) -> None:
        """Fill no slab further: each is freed once its buffers and views are gone; the
        rows faulted in ahead and never handed out are given back now, not with the last
        view (and keep no spare)."""
        for slab in self._filling.values():
            if slab.faulted > slab.used:
                _Populator.submit(slab, slab.used, slab.faulted, _Populator.MADV_DONTNEED)
                slab.faulted = slab.used
        self._filling.clear()
        self._spare.clear()
        self._taken = 0

    def filling(self, slab: Slab) -> bool:
        return self._filling.get(slab.rows.shape[1]) is slab


def _fault(slab: Slab, end: int) -> None:
    """Have rows past the regions handed out, up to ``end``, faulted in (once each)."""
    lo, hi = max(slab.faulted, slab.used), min(end, len(slab.pos))
    if hi > lo:
        slab.faulted = hi
        _Populator.submit(slab, lo, hi, _Populator.MADV_POPULATE_WRITE)


def retire(buffers: list[TapRows], pool: SlabPool) -> None:
    """The buffers of collected requests leave their slabs' accounts; a slab left
    sparse moves its survivors' rows not handed out into memory of their own, so one
    long request keeps no more than its own rows (and views held keep theirs)."""
    touched = set()
    for t in buffers:
        if t.home is not None:
            t.home[0].leave(t)
            touched.add(t.home[0])
    for slab in touched:
        if not pool.filling(slab) and slab.sparse():
            for t in list(slab.buffers):
                t._move(len(t._pos))


class TapRows:
    """One request's rows at one tap, viewed as ``[n, width]`` of ``dtype`` (no
    ``extra`` columns: its slabs' are not kept).

    Rows ``start .. end`` are held and not handed out yet (DELTA outputs move
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
            self.home[0].leave(self)
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


class SlotRows:
    """One stream's rows of every pending request, by the request's slot: per-slot
    numpy arrays say where each one's rows are, so a message's rows, for all of its
    requests, are written with one scatter per slab.

    A slot's rows ``start .. end`` of its region are held and not handed out yet
    (DELTA outputs move ``start``); ``released`` rows handed out before were let go
    when its region moved (it grew, or left a sparse slab). Slabs come from a pool of
    the stream's own (``slab_bytes``, not faulted in ahead); ``stores`` holds those
    with live regions (and the one being filled), by ``id``: a slot's ``sid``."""

    row_bytes: int | None = None
    """Bytes per row, known from the stream's first message."""

    def __init__(
        self,
        slots: int,
        slab_bytes: int,
        extra: tuple[str, ...] = (),
        typed: tuple[str, type] | None = None,
    ) -> None:
        self._slab_bytes = slab_bytes
        self._columns = (extra, typed)
        self._pool: SlabPool | None = None
        self.stores: dict[int, Slab] = {}
        self.filling = -1
        self.wants = np.zeros(slots, bool)
        self.sid = np.full(slots, -1, np.int64)
        self.base = np.zeros(slots, np.int64)
        self.cap = np.zeros(slots, np.int64)
        self.start = np.zeros(slots, np.int64)
        self.end = np.zeros(slots, np.int64)
        self.released = np.zeros(slots, np.int64)
        self.last = np.full(slots, -1, np.int64)
        """The position of each slot's last row written."""
        self.ended = np.zeros(slots, bool)
        """The request's end came on this stream: all of its rows here have come."""

    _FILL: ClassVar[dict[str, int]] = {"sid": -1, "last": -1}

    def grow_slots(self, slots: int) -> None:
        for name in ("wants", "sid", "base", "cap", "start", "end", "released", "last", "ended"):
            old = getattr(self, name)
            new = np.full(slots, self._FILL.get(name, 0), old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def place(self, slots: np.ndarray, caps: np.ndarray) -> None:
        """Fresh regions of ``caps`` rows for ``slots`` (whose rows, if any, the caller
        moves), contiguous in the slab being filled."""
        row_bytes = self.row_bytes
        assert row_bytes is not None
        if self._pool is None:  # rows per slab: those of its bytes, with 24 per row
            per_slab = self._slab_bytes // (24 + max(row_bytes, 1))
            self._pool = SlabPool(per_slab * max(row_bytes, 1), False, *self._columns)
        total = int(caps.sum())
        slab, base = self._pool.take(total, row_bytes)
        sid = id(slab)
        if sid != self.filling:
            old = self.stores.get(self.filling)
            if old is not None and old.live == 0:
                del self.stores[self.filling]
            self.filling = sid
            self.stores[sid] = slab
        self.sid[slots] = sid
        self.base[slots] = base + np.cumsum(caps) - caps

        self.cap[slots] = caps

    def move(self, slot: int, cap: int) -> None:
        """The slot's rows not handed out yet into a fresh region of ``cap`` rows."""
        old_sid, b = int(self.sid[slot]), int(self.base[slot])
        s, e, old_cap = int(self.start[slot]), int(self.end[slot]), int(self.cap[slot])
        old = self.stores[old_sid]
        self.place(np.array([slot]), np.array([cap]))
        new, nb, n = self.stores[int(self.sid[slot])], int(self.base[slot]), e - s
        new.pos[nb : nb + n] = old.pos[b + s : b + e]
        new.tok[nb : nb + n] = old.tok[b + s : b + e]
        new.rows[nb : nb + n] = old.rows[b + s : b + e]
        for name in self._columns[0]:
            new.cols[name][nb : nb + n] = old.cols[name][b + s : b + e]
        self.released[slot] += s
        self.start[slot], self.end[slot] = 0, n
        self._unref(old_sid, old_cap)

    def _unref(self, sid: int, rows: int) -> None:
        st = self.stores[sid]
        st.live -= rows
        if st.live == 0 and sid != self.filling:
            del self.stores[sid]

    def free(self, slot: int) -> None:
        """The slot's request was collected or forgotten."""
        sid = int(self.sid[slot])
        if sid >= 0:
            self._unref(sid, int(self.cap[slot]))
            if self.filling == sid and self.stores[sid].live == 0:
                del self.stores[sid]  # idle: the next region starts a fresh slab
                self.filling = -1
                if self._pool is not None:
                    self._pool.release()
        self.wants[slot] = self.ended[slot] = False
        self.sid[slot] = self.last[slot] = -1
        self.base[slot] = self.cap[slot] = self.start[slot] = self.end[slot] = 0
        self.released[slot] = 0

    def compact(self) -> None:
        """Slabs other than the one being filled whose live regions hold under a
        quarter of their rows move those out: one long request keeps no more than its
        own rows alive (views handed out keep theirs)."""
        for sid, st in list(self.stores.items()):
            if sid != self.filling and st.sparse():
                for slot in np.flatnonzero(self.sid == sid).tolist():
                    self.move(slot, int(self.cap[slot]))

    def pending(self, slot: int, limit: int) -> tuple[Slab, int, int] | None:
        """The slot's rows not handed out yet with position below ``limit``: their
        slab, first row there and count (None: no rows came yet)."""
        sid = int(self.sid[slot])
        if sid < 0:
            return None
        st = self.stores[sid]
        b, s, e = int(self.base[slot]), int(self.start[slot]), int(self.end[slot])
        lo, n = b + s, e - s
        last = int(self.last[slot])
        if n and last >= limit:
            first = int(st.pos[lo])
            if last - first == n - 1:  # every position in between (the usual case)
                n = max(0, min(n, limit - first))
            else:
                n = int(np.searchsorted(st.pos[lo : b + e], limit))
        return st, lo, n

    def pending_below(self, slot: int, limit: int) -> int:
        """Rows of ``slot`` not handed out yet with position below ``limit``."""
        got = self.pending(slot, limit)
        return got[2] if got is not None else 0

    def held_below(self, slot: int, limit: int) -> int:
        """Rows of ``slot`` with position below ``limit``, handed out or not."""
        return int(self.released[slot] + self.start[slot]) + self.pending_below(slot, limit)

    def write(
        self,
        slots: np.ndarray,
        lo: np.ndarray,
        cnt: np.ndarray,
        every: bool,
        positions: np.ndarray,
        token_ids: np.ndarray,
        items: np.ndarray,
        extra: dict[str, int],
        first_cap: np.ndarray,
    ) -> None:
        """Rows ``lo[i] .. lo[i] + cnt[i]`` of a message to slot ``slots[i]``'s region
        (``every``: those are all of the message's rows, in order): ``items`` are the
        message's rows (``as_items``), ``extra`` a value per column for all of them.
        Numpy work whose size does not depend on the number of requests, but for
        regions made or grown (``first_cap``: the rows a new region makes room for)."""
        new = self.sid[slots] < 0
        if new.any():
            self.place(slots[new], first_cap[new])
        end = self.end[slots]
        over = end + cnt > self.cap[slots]
        if over.any():
            for slot, k in zip(slots[over].tolist(), cnt[over].tolist(), strict=True):
                live = int(self.end[slot] - self.start[slot])
                self.move(slot, max(2 * (live + k), MIN_CAPACITY))
            end = self.end[slots]
        dst = self.base[slots] + end
        total = int(cnt.sum())
        if total == len(slots):  # a decode step: one row each
            src: np.ndarray | slice = slice(None) if every else lo
        else:
            before = np.cumsum(cnt) - cnt
            ar = np.arange(total)
            dst = np.repeat(dst - before, cnt) + ar
            src = slice(None) if every else np.repeat(lo - before, cnt) + ar
        sid = self.sid[slots]
        first = int(sid[0])
        if (sid == first).all():
            groups: list[tuple[int, Any]] = [(first, None)]
        else:  # rows in several slabs (some regions moved): one scatter each
            row_sid = sid if total == len(slots) else np.repeat(sid, cnt)
            groups = [(int(g), row_sid == g) for g in np.unique(sid)]
        for g, mask in groups:
            st = self.stores[g]
            d, s = dst, src
            if mask is not None:
                d = dst[mask]
                s = np.flatnonzero(mask) if isinstance(src, slice) else src[mask]
            st.pos[d] = positions[s]
            st.tok[d] = token_ids[s]
            for name, value in extra.items():
                st.cols[name][d] = value
            st.items[d] = items[s]
        self.end[slots] = end + cnt
        self.last[slots] = positions[lo + cnt - 1]


class _Populator:
    """One thread per process that faults slabs' pages in ahead of their use, and gives
    back those never used (in the order asked)."""

    _queue: queue.SimpleQueue[tuple[weakref.ref[Slab], int, int, int]] = queue.SimpleQueue()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()
    _works: bool | None = None
    _madvise = None
    MADV_POPULATE_WRITE = 23  # Linux 5.14+
    MADV_DONTNEED = 4

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
    def submit(cls, slab: Slab, lo: int, hi: int, advice: int) -> None:
        """Fault in (``MADV_POPULATE_WRITE``) or give back (``MADV_DONTNEED``: rows no
        buffer was handed) rows ``lo .. hi`` of ``slab``."""
        with cls._lock:
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="actbus-prefault", daemon=True)
                cls._thread.start()
        # A slab let go meanwhile is not kept for this.
        cls._queue.put((weakref.ref(slab), lo, hi, advice))

    @classmethod
    def _run(cls) -> None:
        while True:
            ref, lo, hi, advice = cls._queue.get()
            slab = ref()
            if slab is None:
                continue
            row, page = slab.rows.shape[1], mmap.PAGESIZE
            # madvise starts at a page: the one row lo is in, or (giving back) the next.
            start = (lo * row + (page - 1 if advice == cls.MADV_DONTNEED else 0)) // page * page
            if hi * row > start:
                # ctypes lets go of the GIL for the call; the slab is held until it returns.
                cls._madvise(slab.rows.ctypes.data + start, hi * row - start, advice)
            del slab
