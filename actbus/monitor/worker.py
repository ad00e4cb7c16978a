"""Worker side of monitors: each step's scores of the requests that asked, on the bus.

Runs inside the capture worker (``CaptureWorker._step``), after the forward, with the
same step view and the same per-row positions capture derives from the scheduler, so
scores are attributed to requests and positions exactly as capture rows are (chunked
prefill, continuous batching, n>1). Like capture it keeps a watermark per request: a
request preempted and recomputed re-runs positions it already published, and their
scores are skipped, so every position's score goes out once.

One message per (monitor, layer) per step: the rows of the requests that asked for it,
the monitor's published columns only, and the version of the weights that made them.
Through the capture publisher's ``admit``: a monitor no subscriber asked for costs
no gather and no copy; a lossy subscriber's drop is counted by the bus like any tap's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from actbus.bus.outlet import Admission, Outlet, TapOffer
from actbus.monitor.graph import MonitorTables
from actbus.request_ids import caller_request_id
from actbus.steps import StepRequests
from actbus.wire import MONITOR_HOOK, Header, MonitorInfo, RequestEnd, RowIndex

_CHILD = re.compile(r"^(\d+)_")
SCORE_BYTES = 4  # float32


@dataclass
class _Request:
    caller_id: str
    sample_index: int
    names: tuple[str, ...]
    tags: dict
    returns: bool = False
    """The caller asked for its scores back (the front end's subscriber gets them)."""
    next_pos: int = 0
    engine_id: str = ""
    """vLLM's own id, for a request whose scores go back (the collector's key)."""


@dataclass(frozen=True)
class Published:
    """What one monitor publishes: its columns at each point (relative to the point's
    table) and what they score."""

    cols: np.ndarray  # int64, within the monitor's segment
    labels: tuple[int, ...]


class MonitorHarvest:
    """Owns the per-request monitor state of one engine's capture worker."""

    def __init__(
        self, tables: MonitorTables, published: dict[str, Published], model_name: str
    ) -> None:
        self.tables = tables
        self.published = published
        self.model_name = model_name
        # (layer, name) -> the point's hook, for every monitor point this rank holds.
        self.keys: dict[tuple[int, str], str] = {
            (layer, name): hook
            for (layer, hook), pt in sorted(tables.points.items())
            for name in pt.segments
        }
        self._index: dict[tuple[int, str], torch.Tensor] = {}  # device column indices
        self._reqs: dict[str, _Request] = {}

    def _admit(self, sr: StepRequests) -> None:
        for rid, _prompt_len, wire in sr.new:
            if rid in self._reqs or not wire or not wire.get("monitor"):
                continue  # resumed after preemption: keep the watermark
            child = _CHILD.match(rid) if int(wire.get("n", 1)) > 1 else None
            self._reqs[rid] = _Request(
                caller_id=str(wire.get("caller_id") or caller_request_id(rid)),
                sample_index=int(child.group(1)) if child else 0,
                names=tuple(wire["monitor"]),
                tags=dict(wire.get("tags") or {}),
                returns=bool(wire.get("monitor_return", False)),
                engine_id=rid if wire.get("monitor_return") else "",
            )

    def _retire(self, sr: StepRequests) -> list[RequestEnd]:
        ended = []
        for rid in sr.finished:
            st = self._reqs.pop(rid, None)
            if st is not None:
                ended.append(
                    RequestEnd(
                        st.caller_id, st.sample_index, sr.reasons.get(rid, "unknown"), st.engine_id
                    )
                )
        return ended

    def step(
        self,
        step: int,
        req_ids: list[str],
        offsets: np.ndarray,
        host_pos: np.ndarray | None,
        token_ids: torch.Tensor,
        sr: StepRequests,
        publisher: Outlet,
        to_host: Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], object]],
    ) -> None:
        """Publish this step's scores (after the forward that wrote them).

        It runs on the engine's own thread between forwards, so its host work does not
        grow with Python calls per request: the rows each monitor publishes are found
        with a few numpy operations over the whole step, the (monitor, layer) streams
        of one monitor share one row index, one gather per point and one host copy.
        """
        self._admit(sr)
        ended = self._retire(sr)
        plans = self._plan(req_ids, offsets, host_pos) if host_pos is not None else {}
        keys = [k for k in self.keys if k[1] in plans or ended]
        if not keys:
            return
        none = _Rows.empty()
        offers = [
            TapOffer(
                k[0],
                MONITOR_HOOK,
                plans.get(k[1], none).num_rows * len(self.published[k[1]].cols) * SCORE_BYTES,
                bool(ended) or plans.get(k[1], none).returning,
            )
            for k in keys
        ]
        send: dict[str, list[tuple[int, str]]] = {}  # monitor -> its streams to copy
        for key, verdict in zip(keys, publisher.admit(step, offers), strict=True):
            if verdict is Admission.SEND:
                send.setdefault(key[1], []).append(key)
            elif verdict is Admission.DROP:  # no copy: counted as a drop by the bus
                width = len(self.published[key[1]].cols)
                header = self._header(step, key, 0, width, RowIndex.empty(), ended)
                header.shape = (plans.get(key[1], none).num_rows, width)
                publisher.drop(header)
        for name, streams in send.items():
            plan = plans.get(name, none)
            scores, toks = self._gather(streams, plan, token_ids, int(offsets[-1]))
            (scores, toks), ready = to_host([scores, toks])
            rows = plan.index(toks)  # one index for every layer of the monitor
            width = scores.shape[2]
            for i, key in enumerate(streams):
                publisher.publish(
                    self._header(step, key, rows.num_rows, width, rows, ended),
                    scores[i],
                    ready=ready,
                )

    def _plan(
        self, req_ids: list[str], offsets: np.ndarray, host_pos: np.ndarray
    ) -> dict[str, _Rows]:
        """Per monitor, the rows of this step it publishes: every row of a request that
        asked for it, except positions published before (recomputed after preemption).
        Moves the requests' watermarks."""
        states = [self._reqs.get(r) for r in req_ids] if self._reqs else []
        counts = np.diff(offsets)
        live = [i for i, st in enumerate(states) if st is not None and counts[i]]
        if not live:
            return {}
        live_ix = np.asarray(live, dtype=np.int64)
        marks = np.fromiter((states[i].next_pos for i in live), np.int64, len(live))
        owner = np.repeat(np.arange(len(states), dtype=np.int64), counts)  # row -> request
        floor = np.full(len(states), np.iinfo(np.int64).max, dtype=np.int64)
        floor[live_ix] = marks
        keep = host_pos >= floor[owner]  # rows of unmonitored requests are never kept
        last = host_pos[offsets[1:][live_ix] - 1] + 1
        for i, mark in zip(live, np.maximum(marks, last).tolist(), strict=True):
            states[i].next_pos = mark
        # Requests asking for the same monitors share one mask (usually: all of them).
        asking: dict[tuple[str, ...], list[int]] = {}
        for i in live:
            asking.setdefault(states[i].names, []).append(i)
        plans: dict[str, _Rows] = {}
        by_askers: dict[tuple[tuple[str, ...], ...], _Rows | None] = {}
        for name in dict.fromkeys(n for names in asking for n in names):
            which = tuple(names for names in asking if name in names)
            if which not in by_askers:
                wants = np.zeros(len(states), dtype=bool)
                for names in which:
                    wants[asking[names]] = True
                rows = np.flatnonzero(keep & wants[owner])
                by_askers[which] = _Rows.of(states, owner, rows, host_pos) if len(rows) else None
            if by_askers[which] is not None:
                plans[name] = by_askers[which]
        return plans

    def _gather(
        self, streams: list[tuple[int, str]], plan: _Rows, token_ids: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``[streams, rows, width]`` scores and ``[rows]`` token ids of ``plan``'s
        rows (slices where they are every row, and the monitor's whole segment)."""
        first = self.tables.points[(streams[0][0], self.keys[streams[0]])].scores
        if plan.num_rows == 0:
            width = len(self.published[streams[0][1]].cols)
            return first.new_zeros((len(streams), 0, width)), token_ids[:0].clone()
        every = plan.num_rows == n
        idx = None if every else torch.from_numpy(plan.rows).to(first.device, non_blocking=True)
        parts = []
        for key in streams:
            pt = self.tables.points[(key[0], self.keys[key])]
            src = pt.scores[:n] if idx is None else pt.scores.index_select(0, idx)
            cols = self._columns(key, pt)
            parts.append(src[:, cols] if isinstance(cols, slice) else src.index_select(1, cols))
        toks = token_ids[:n].clone() if idx is None else token_ids.index_select(0, idx)
        return torch.stack(parts), toks

    def _columns(self, key: tuple[int, str], pt) -> slice | torch.Tensor:
        """A stream's published columns in its point's table: a slice when they are
        one contiguous run, else a device index."""
        cols = self._index.get(key)
        if cols is None:
            seg = pt.segments[key[1]]
            want = self.published[key[1]].cols + seg.lo
            if len(want) and np.array_equal(want, np.arange(want[0], want[0] + len(want))):
                cols = slice(int(want[0]), int(want[0]) + len(want))
            else:
                cols = torch.from_numpy(want).to(pt.scores.device)
            self._index[key] = cols
        return cols

    def _header(self, step, key, n, width, rows: RowIndex, ended) -> Header:
        layer, name = key
        pub = self.published[name]
        return Header(
            step=step,
            layer=layer,
            hook=MONITOR_HOOK,
            dtype="float32",
            shape=(n, width),
            model=self.model_name,
            rows=rows,
            ended=ended,
            monitor=MonitorInfo(name, self.tables.versions[name], self.keys[key], pub.labels),
        )


@dataclass
class _Rows:
    """The rows one monitor publishes in a step: the step's row numbers (batch order,
    grouped by request), their positions, and the requests they belong to."""

    requests: list[_Request]
    counts: np.ndarray  # int64 [requests]: rows of each
    rows: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]

    @classmethod
    def empty(cls) -> _Rows:
        z = np.zeros(0, dtype=np.int64)
        return cls([], z, z, z)

    @classmethod
    def of(cls, states: list, owner: np.ndarray, rows: np.ndarray, host_pos: np.ndarray) -> _Rows:
        per = np.bincount(owner[rows], minlength=len(states))
        who = np.flatnonzero(per)
        return cls([states[i] for i in who.tolist()], per[who], rows, host_pos[rows])

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @cached_property
    def returning(self) -> bool:
        return any(st.returns for st in self.requests)

    def index(self, toks: torch.Tensor) -> RowIndex:
        tags = [st.tags for st in self.requests]
        returned = [st.returns for st in self.requests]
        return RowIndex(
            request_ids=[st.caller_id for st in self.requests],
            offsets=np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).astype(np.int64),
            positions=self.positions,
            token_ids=toks.numpy(),
            sample_index=[st.sample_index for st in self.requests],
            tags=tags if any(tags) else [],
            returned=returned if any(returned) else [],
            engine_ids=[st.engine_id for st in self.requests] if any(returned) else [],
        )
