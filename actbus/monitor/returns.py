"""Monitor scores handed back to the caller (``extra_args["actbus"]["monitor_return"]``).

Scores are published on the bus like any others (``actbus.monitor.worker``). The front
end (``LLM``, ``AsyncLLM``, the OpenAI server) runs one lossless subscriber of its own
to the ``monitor`` hook, filtered at the publisher to the requests that asked
(``Subscription.returned_only``, the worker marks them ``returned``), and attaches
what has arrived to each output of such a request as ``CompletionOutput.monitor_scores``
(a ``MonitorScores``). So the caller gets the very values any bus subscriber gets.

Every output covers positions ``0 .. prompt_len + n_generated - 2``: the tokens fed
to the model so far (the last generated token is scored once it is fed, so never).
A streamed output carries the scores that have arrived, the same prefix of positions
for every (monitor, layer); DELTA outputs carry each position once, CUMULATIVE ones
all so far. The final output waits (bounded: ``actbus.capture.collector``) until every
position's score is there (or the request's end came on that monitor's stream) and
says in ``complete`` whether it got them all.

The receiving thread shares the GIL with vLLM's output processing, so its work per
message does not grow with Python calls per request: each (monitor, layer) stream
keeps every pending request's scores in a region of shared arrays (``_Store``), found
by the request's slot through per-slot numpy arrays (``_StreamRows``), and a message's
scores, for all of its requests, are written with one numpy scatter. Regions are
sized from the token budget and grow geometrically (rows a DELTA reader took are let
go then; views handed out keep theirs: regions are never reused).

Memory per request is its scores (``tokens x width x 4`` bytes per monitor and layer,
and 24 bytes of position, token id and version per row). A store whose live requests
hold under a quarter of it moves them out, so one long request keeps only its own rows.
A request whose caller went away is forgotten at once (``forget``, from the output
processor's abort) or, failing that, ``FORGET_AFTER_S`` after its end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch
from actbus.capture.collector import (  # noqa: F401  (the timeouts: named here too)
    FORGET_AFTER_S,
    FORGET_UNENDED_S,
    RETURN_TIMEOUT_S,
    Collector,
    Registry,
)
from actbus.wire import MONITOR_HOOK, RowIndex

log = logging.getLogger("actbus.monitor.returns")
WHERE = "extra_args.actbus.monitor_return"
INITIAL_BYTES = 1 << 20
"""A series starts with room for its token budget, at most this much (wide SAE monitors)."""
STORE_BYTES = 16 << 20
"""One stream's scores of many requests share an allocation of about this size."""
MIN_ROWS = 16

Stream = tuple[str, int]
"""(monitor name, layer): one series of scores."""


@dataclass
class MonitorScores:
    """One request's (one sample's) returned scores, rows in position order.

    Every (monitor, layer) series has a row for each of ``positions``; ``values`` are
    float32 ``[n, width]`` (width 1 for a probe or a raw direction, the listed
    features for an SAE, named by ``labels``), ``versions`` int64 ``[n]``: the version
    of the monitor's weights that produced each row."""

    positions: torch.Tensor
    """int64 ``[n]``: token positions (prompt first)."""
    token_ids: torch.Tensor
    """int64 ``[n]``: the token fed at each position."""
    values: dict[Stream, torch.Tensor]
    versions: dict[Stream, torch.Tensor]
    labels: dict[str, tuple[int, ...]]
    complete: bool
    """Every position's score is here for every series (final outputs)."""

    def __getitem__(self, key: str | Stream) -> torch.Tensor:
        """``scores["toxic"]`` (a monitor at one layer) or ``scores["toxic", 16]``."""
        if isinstance(key, tuple):
            return self.values[key]
        layers = [lay for name, lay in self.values if name == key]
        if len(layers) != 1:
            have = sorted({n for n, _ in self.values})
            raise KeyError(
                f"monitor {key!r} has scores at layers {layers}; index with (name, layer)"
                if layers
                else f"no monitor {key!r} in these scores (have {have})"
            )
        return self.values[(key, layers[0])]

    @staticmethod
    def join(first: MonitorScores | None, then: MonitorScores) -> MonitorScores:
        """Two consecutive DELTA pieces as one (vLLM merges outputs a slow reader has
        not taken yet)."""
        if first is None:
            return then
        return MonitorScores(
            torch.cat([first.positions, then.positions]),
            torch.cat([first.token_ids, then.token_ids]),
            {k: _cat(first.values[k], v) for k, v in then.values.items()},
            {k: torch.cat([first.versions[k], v]) for k, v in then.versions.items()},
            then.labels,
            then.complete,
        )

    def to_json(self, final: bool) -> dict[str, Any]:
        """The HTTP form (``choices[i].actbus.monitor``); see docs/monitors.md.

        Each value is the shortest decimal that reads back as the same float32, so a
        client's ``np.float32(x)`` is the exact score; a non-finite one is ``null``."""
        scores: dict[str, list[dict[str, Any]]] = {}
        for (name, layer), v in self.values.items():
            entry: dict[str, Any] = {
                "layer": layer,
                "version": self.versions[(name, layer)].tolist(),
                "values": _shortest(v.numpy()),
            }
            if self.labels.get(name):
                entry["labels"] = list(self.labels[name])
            scores.setdefault(name, []).append(entry)
        out: dict[str, Any] = {
            "positions": self.positions.tolist(),
            "token_ids": self.token_ids.tolist(),
            "scores": scores,
        }
        if final:
            out["complete"] = self.complete
        return out


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` then ``b``; a piece without rows may have width 0 (made before any
    of its stream's scores came)."""
    return torch.cat([a, b]) if len(a) and len(b) else (b if len(b) else a)


def _shortest(a: np.ndarray) -> list[list[float | None]]:
    """float32 ``[n, w]`` as nested lists of doubles whose shortest repr is the float32's."""
    text = a.astype(np.float32).astype(str).tolist()
    finite = np.isfinite(a).tolist()
    return [
        [float(t) if ok else None for t, ok in zip(row, oks, strict=True)]
        for row, oks in zip(text, finite, strict=True)
    ]


class _Store:
    """One allocation of one stream's scores, shared by many requests' regions. Regions
    are handed out in order and never reused, so a view handed out stays valid; the
    memory is freed once no region and no view refers to it."""

    __slots__ = ("live", "pos", "tok", "used", "val", "ver")

    def __init__(self, rows: int, width: int) -> None:
        self.pos = np.empty(rows, np.int64)
        self.tok = np.empty(rows, np.int64)
        self.ver = np.empty(rows, np.int64)
        self.val = np.empty((rows, width), np.float32)
        self.used = 0
        self.live = 0
        """Rows of the regions of requests not collected yet."""


class _StreamRows:
    """One (monitor, layer) stream's scores of every pending request, by the request's
    slot: per-slot numpy arrays say where each one's rows are, so a message's rows,
    for all of its requests, are written with one scatter per store.

    A slot's rows ``start .. end`` of its region are held and not handed out yet
    (DELTA outputs move ``start``); ``released`` rows handed out before were let go
    when its region moved (it grew, or left a sparse store)."""

    def __init__(self, slots: int) -> None:
        self.width: int | None = None
        """Scores per row, from the first message."""
        self.expected_width = 0
        """What the front end's config says it will be: the width of an output made
        before any score came (so a request's pieces always concatenate)."""
        self.labels: tuple[int, ...] = ()
        self.stores: dict[int, _Store] = {}
        self.filling = -1
        self._next = 0
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
        moves), contiguous in the store being filled."""
        assert self.width is not None
        total = int(caps.sum())
        st = self.stores.get(self.filling)
        if st is None or st.used + total > len(st.pos):
            if st is not None and st.live == 0:
                del self.stores[self.filling]
            rows = max(STORE_BYTES // (24 + 4 * max(self.width, 1)), total)
            self.filling, self._next = self._next, self._next + 1
            st = self.stores[self.filling] = _Store(rows, self.width)
        self.sid[slots] = self.filling
        self.base[slots] = st.used + np.cumsum(caps) - caps
        self.cap[slots] = caps
        st.used += total
        st.live += total

    def move(self, slot: int, cap: int) -> None:
        """The slot's rows not handed out yet into a fresh region of ``cap`` rows."""
        old_sid, b = int(self.sid[slot]), int(self.base[slot])
        s, e, old_cap = int(self.start[slot]), int(self.end[slot]), int(self.cap[slot])
        old = self.stores[old_sid]
        self.place(np.array([slot]), np.array([cap]))
        new, nb, n = self.stores[int(self.sid[slot])], int(self.base[slot]), e - s
        new.pos[nb : nb + n] = old.pos[b + s : b + e]
        new.tok[nb : nb + n] = old.tok[b + s : b + e]
        new.ver[nb : nb + n] = old.ver[b + s : b + e]
        new.val[nb : nb + n] = old.val[b + s : b + e]
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
                del self.stores[sid]
                self.filling = -1
        self.wants[slot] = self.ended[slot] = False
        self.sid[slot] = self.last[slot] = -1
        self.base[slot] = self.cap[slot] = self.start[slot] = self.end[slot] = 0
        self.released[slot] = 0

    def compact(self) -> None:
        """Stores other than the one being filled whose live regions hold under a
        quarter of their rows move those out: one long request keeps no more than its
        own rows alive (views handed out keep theirs)."""
        for sid, st in list(self.stores.items()):
            if sid != self.filling and 4 * st.live < len(st.pos):
                for slot in np.flatnonzero(self.sid == sid).tolist():
                    self.move(slot, int(self.cap[slot]))

    def pending(self, slot: int, limit: int) -> tuple[_Store, int, int] | None:
        """The slot's rows not handed out yet with position below ``limit``: their
        store, first row there and count (None: no rows came yet)."""
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
        rows: RowIndex,
        values: np.ndarray,
        version: int,
        first_cap: np.ndarray,
    ) -> None:
        """Rows ``lo[i] .. lo[i] + cnt[i]`` of a message to slot ``slots[i]``'s region
        (``every``: those are all of the message's rows, in order): numpy work whose
        size does not depend on the number of requests, but for regions made or grown."""
        new = self.sid[slots] < 0
        if new.any():
            self.place(slots[new], first_cap[new])
        end = self.end[slots]
        over = end + cnt > self.cap[slots]
        if over.any():
            for slot, k in zip(slots[over].tolist(), cnt[over].tolist(), strict=True):
                live = int(self.end[slot] - self.start[slot])
                self.move(slot, max(2 * (live + k), MIN_ROWS))
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
        else:  # rows in several stores (some regions moved): one scatter each
            row_sid = sid if total == len(slots) else np.repeat(sid, cnt)
            groups = [(int(g), row_sid == g) for g in np.unique(sid)]
        for g, mask in groups:
            st = self.stores[g]
            d, s = dst, src
            if mask is not None:
                d = dst[mask]
                s = np.flatnonzero(mask) if isinstance(src, slice) else src[mask]
            st.pos[d] = rows.positions[s]
            st.tok[d] = rows.token_ids[s]
            st.ver[d] = version
            st.val[d] = values[s]
        self.end[slots] = end + cnt
        self.last[slots] = rows.positions[lo + cnt - 1]


@dataclass
class _Pending:
    prompt_len: int
    slot: int
    streams: tuple[Stream, ...]
    ended_at: float | None = None
    created: float = field(default_factory=time.monotonic)


_EMPTY = np.zeros(0, np.int64)


class ScoreCollector(Collector):
    """The front end's subscriber for returned scores, shared by its requests (one per
    set of publishers; under data parallelism it reads every rank it serves).

    Each pending sample has a slot, and each (monitor, layer) stream keeps its
    requests' rows in regions of shared arrays, found by slot: a message's scores, for
    every request in it, are written with one numpy scatter. Per-request Python work
    is done when a request is admitted, when its region is first made or grows, when
    it ends, and when its outputs are made; once per step, the message's request ids
    are mapped to slots (shared by the step's messages)."""

    where = WHERE
    thread_name = "actbus-scores"
    what = "scores"

    def __init__(self, addresses: str | list[str]) -> None:
        self._slot: dict[tuple[str, int], int] = {}
        self._free: list[int] = []
        self._slots = 0
        self._room = 64
        self._first_cap = np.zeros(self._room, np.int64)
        self._streams: dict[Stream, _StreamRows] = {}
        self._generation = 0
        self._plan: tuple[Any, int, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] | None = None
        super().__init__(addresses)

    def subscription(self) -> Subscription:
        return Subscription(
            policy="block", hooks=(MONITOR_HOOK,), returned_only=True, name="actbus-scores"
        )

    @classmethod
    def for_config(cls, cfg: Any, dp: Any = None) -> ScoreCollector:
        """The collector of the publishers of the data-parallel ranks ``dp`` serves
        (default: rank 0); refuses what it cannot reach."""
        addrs = cls.refuse(cfg, dp, "read scores with ScoreReader")
        return _REGISTRY.get(addrs, cls)  # type: ignore[return-value]

    # ------------------------------------------------------------- front end side
    def expect(
        self,
        request_id: str,
        n: int,
        streams: tuple[Stream, ...],
        prompt_len: int,
        max_tokens: int | None = None,
        widths: dict[str, int] | None = None,
        *,
        index: int = 0,
    ) -> None:
        """Register samples ``index .. index + n - 1`` of a request before it is queued
        (the front end: each under vLLM's own id of it, as ``ReturnCollector.expect``);
        ``widths``: each monitor's scores per row, as configured (for outputs made
        before any came)."""
        capacity = prompt_len + min(max_tokens or 256, 4096)
        with self._cond:
            for i in range(index, index + n):
                key = (request_id, i)
                if key in self._pending:  # an id used again: the old one is gone
                    self._drop(key)
                slot = self._new_slot()
                self._pending[key] = _Pending(prompt_len, slot, streams)
                self._slot[key] = slot
                self._first_cap[slot] = capacity
                for s in streams:
                    t = self._streams.get(s)
                    if t is None:
                        t = self._streams[s] = _StreamRows(self._room)
                    if widths and not t.expected_width:
                        t.expected_width = widths.get(s[0], 0)
                    t.wants[slot] = True
            self._generation += 1
            self._own(request_id)

    def _new_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._slots == self._room:
            self._room *= 2
            cap = np.zeros(self._room, np.int64)
            cap[: self._slots] = self._first_cap
            self._first_cap = cap
            for t in self._streams.values():
                t.grow_slots(self._room)
        self._slots += 1
        return self._slots - 1

    def forget(self, request_ids: list[str]) -> None:
        """Drop these requests' scores: their caller went away."""
        ids = set(request_ids)
        with self._cond:
            for key in [k for k in self._pending if k[0] in ids]:
                self._drop(key)
            for c in ids:
                self._disown_if_done(c)

    def take(
        self,
        request_id: str,
        index: int,
        num_generated: int,
        *,
        final: bool,
        delta: bool,
        wait: bool = True,
    ) -> MonitorScores | None:
        """The scores for an output with ``num_generated`` tokens so far; a final one
        waits for the missing ones (bounded, see ``actbus.capture.collector``) unless
        ``wait`` is false (an abort)."""
        key = (request_id, index)
        with self._cond:
            p = self._pending.get(key)
            if p is None:
                return None
            limit = p.prompt_len + num_generated - 1  # positions fed so far
            if final:
                bound = RETURN_TIMEOUT_S if wait else 0.0
                self._wait_final(
                    lambda: self._pending.get(key) is not p or self._arrived(p, limit), bound
                )
                if self._pending.get(key) is not p:  # forgotten meanwhile (an abort)
                    return None
            out = self._hand_out(p, limit, delta)
            if final:
                out.complete = self._arrived(p, limit)
                self._drop(key)
                self._disown_if_done(request_id)
        if final and wait and not out.complete:
            log.warning(
                "actbus: request %s sample %d: %d of %d positions' scores arrived",
                request_id, index, len(out.positions), limit,
            )  # fmt: skip
        return out

    def _arrived(self, p: _Pending, limit: int) -> bool:
        """Every stream has a score for each position below ``limit``, or its end came
        (a stream's messages arrive in order, the end after its last scores)."""
        slot = p.slot
        for s in p.streams:
            t = self._streams[s]
            if t.ended[slot]:
                continue
            if t.sid[slot] < 0 or t.held_below(slot, limit) < limit:
                return False
        return True

    def _hand_out(self, p: _Pending, limit: int, delta: bool) -> MonitorScores:
        """Rows below ``limit`` present in every stream: those not handed out yet
        (DELTA, which marks them handed out) or all (CUMULATIVE); views, not copies."""
        slot = p.slot
        ts = [self._streams[s] for s in p.streams]
        held = [t.pending(slot, limit) for t in ts]
        n = min((h[2] if h is not None else 0) for h in held) if held else 0
        values, versions, labels = {}, {}, {}
        positions = token_ids = _EMPTY
        for s, t, h in zip(p.streams, ts, held, strict=True):
            if h is None:  # none of its scores came yet: no rows, the stream's width
                width = t.width or t.expected_width
                values[s] = torch.zeros((0, width), dtype=torch.float32)
                versions[s] = torch.zeros(0, dtype=torch.int64)
                continue
            st, lo, _ = h
            positions, token_ids = st.pos[lo : lo + n], st.tok[lo : lo + n]
            values[s] = torch.from_numpy(st.val[lo : lo + n])
            versions[s] = torch.from_numpy(st.ver[lo : lo + n])
            labels[s[0]] = t.labels
            if delta and n:
                t.start[slot] += n
        return MonitorScores(
            torch.from_numpy(positions),
            torch.from_numpy(token_ids),
            values,
            versions,
            labels,
            complete=False,
        )

    def _drop(self, key: tuple[str, int]) -> None:
        p = self._pending.pop(key, None)
        if p is None:
            return
        del self._slot[key]
        for s in p.streams:
            self._streams[s].free(p.slot)
        self._free.append(p.slot)
        self._generation += 1

    def _housekeep(self, dropped: bool) -> None:
        for t in self._streams.values():
            t.compact()

    # ------------------------------------------------------------- receiving side
    def _slots_of(self, rows: RowIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Under ``_cond``: each request's slot (-1: not one of ours), first row and
        row count; made once per row index (a step's messages share one) while no
        slot changed hands."""
        plan = self._plan
        if plan is not None and plan[0] is rows and plan[1] == self._generation:
            return plan[2]
        get = self._slot.get
        ids, si = rows.keys(), rows.sample_index  # vLLM's own ids: caller ids may repeat
        keys = zip(ids, si, strict=True) if si else ((r, 0) for r in ids)
        slots = np.fromiter((get(k, -1) for k in keys), np.int64, len(ids))
        off = rows.offsets
        made = (slots, off[:-1], np.diff(off), len(off) == 0 or int(off[0]) == 0)
        self._plan = (rows, self._generation, made)
        return made

    def _add(self, b: Batch) -> None:
        h = b.header
        mon = h.monitor
        if mon is None:
            return
        stream = (mon.name, h.layer)
        with self._cond:
            t = self._streams.get(stream)
            if t is not None and b.tensor.numel():
                self._write(t, h.rows, b.tensor.numpy(), mon)
            now = time.monotonic()
            for end in h.ended:
                key = (end.key, end.sample_index)
                p = self._pending.get(key)
                if p is not None:
                    if t is not None:
                        t.ended[p.slot] = True
                    p.ended_at = p.ended_at or now
            self._cond.notify_all()

    def _write(self, t: _StreamRows, rows: RowIndex, values: np.ndarray, mon: Any) -> None:
        slots, lo, cnt, zero_based = self._slots_of(rows)
        if not len(slots):
            return
        ok = (slots >= 0) & (cnt > 0)
        ok &= t.wants[np.maximum(slots, 0)]
        every = bool(ok.all()) and zero_based
        if not every:
            if not ok.any():
                return  # another front end's requests, or ones already collected
            slots, lo, cnt = slots[ok], lo[ok], cnt[ok]
        if t.width is None:
            t.width, t.labels = values.shape[1], tuple(mon.labels)
        elif values.shape[1] != t.width:
            log.error(
                "actbus: monitor %r at layer %d sent %d scores per row, not %d; dropped",
                mon.name, values.shape[0], values.shape[1], t.width,
            )  # fmt: skip
            return
        first = np.minimum(self._first_cap[slots], max(16, INITIAL_BYTES // (4 * t.width)))
        t.write(slots, lo, cnt, every, rows, values, int(mon.version), first)


_REGISTRY = ScoreCollector.registry = Registry()
_COLLECTORS = _REGISTRY.collectors
_OWNER = _REGISTRY.owner
"""Request id (vLLM's own) -> the collector holding its scores, for the output wrapper."""


def collector_for(request_id: str) -> ScoreCollector | None:
    return _OWNER.get(request_id)  # type: ignore[return-value]


def forget(request_ids: list[str]) -> None:
    """Drop the scores of requests whose caller went away (an abort)."""
    for col in {id(c): c for c in (_OWNER.get(r) for r in request_ids) if c}.values():
        col.forget(request_ids)  # type: ignore[attr-defined]


def close_collectors(addresses: list[str]) -> int:
    """Close the collectors reading any of these publishers, whose engine stopped."""
    return _REGISTRY.close(addresses)
