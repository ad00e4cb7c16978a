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
all so far. The final output waits (bounded: ``actbus.collector``) until every
position's score is there (or the request's end came on that monitor's stream) and
says in ``complete`` whether it got them all.

The receiving thread shares the GIL with vLLM's output processing, so its work per
message does not grow with Python calls per request: each (monitor, layer) stream
keeps every pending request's scores in a region of slabs shared by many requests,
found by the request's slot through per-slot numpy arrays (``actbus.rowstore.SlotRows``),
and a message's scores, for all of its requests, are written with one numpy scatter.
Regions are sized from the token budget and grow geometrically (rows a DELTA reader
took are let go then; views handed out keep theirs: regions are never reused).

Memory per request is its scores (``tokens x width x 4`` bytes per monitor and layer,
and 24 bytes of position, token id and version per row). A slab whose live requests
hold under a quarter of it moves them out, so one long request keeps only its own rows.
A request whose caller went away is forgotten at once (``forget``, from the output
processor's abort) or, failing that, ``FORGET_AFTER_S`` after its end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch
from actbus.collector import (  # noqa: F401  (the timeouts: named here too)
    FORGET_AFTER_S,
    FORGET_UNENDED_S,
    RETURN_TIMEOUT_S,
    Collector,
    Registry,
)
from actbus.rowstore import SlotRows, as_items
from actbus.wire import MONITOR_HOOK, RowIndex

log = logging.getLogger("actbus.monitor.returns")
WHERE = "extra_args.actbus.monitor_return"
INITIAL_BYTES = 1 << 20
"""A series starts with room for its token budget, at most this much (wide SAE monitors)."""
STORE_BYTES = 16 << 20
"""One stream's scores of many requests share an allocation of about this size."""

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


class _StreamRows(SlotRows):
    """One (monitor, layer) stream's scores of every pending request, by the request's
    slot (``actbus.rowstore.SlotRows``): float32 rows of ``width`` scores (``val``),
    with the version of the weights that made each (``ver``)."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots, STORE_BYTES, extra=("ver",), typed=("val", np.float32))
        self.expected_width = 0
        """What the front end's config says it will be: the width of an output made
        before any score came (so a request's pieces always concatenate)."""
        self.labels: tuple[int, ...] = ()

    @property
    def width(self) -> int | None:
        """Scores per row, from the first message."""
        return None if self.row_bytes is None else self.row_bytes // 4

    @width.setter
    def width(self, width: int) -> None:
        self.row_bytes = 4 * width

    def write(  # type: ignore[override]
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
        """Rows ``lo[i] .. lo[i] + cnt[i]`` of a message (``values``: its float32 scores,
        made by weights ``version``) to slot ``slots[i]``'s region."""
        items = as_items(np.ascontiguousarray(values, dtype=np.float32).view(np.uint8))
        extra = {"ver": version}
        super().write(
            slots, lo, cnt, every, rows.positions, rows.token_ids, items, extra, first_cap
        )


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
    instead = "read scores with ScoreReader"
    registry = Registry()

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
        waits for the missing ones (bounded, see ``actbus.collector``) unless
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
            values[s] = torch.from_numpy(st.cols["val"][lo : lo + n])
            versions[s] = torch.from_numpy(st.cols["ver"][lo : lo + n])
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


_REGISTRY = ScoreCollector.registry
_COLLECTORS = _REGISTRY.collectors
_OWNER = _REGISTRY.owner
"""Request id (vLLM's own) -> the collector holding its scores, for the output wrapper."""


def collector_for(request_id: str) -> ScoreCollector | None:
    return _REGISTRY.collector_for(request_id)


def forget(request_ids: list[str]) -> None:
    """Drop the scores of requests whose caller went away (an abort)."""
    _REGISTRY.forget(request_ids)


def close_collectors(addresses: list[str]) -> int:
    """Close the collectors reading any of these publishers, whose engine stopped."""
    return _REGISTRY.close(addresses)
