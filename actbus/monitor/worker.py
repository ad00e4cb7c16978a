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

import numpy as np
import torch

from actbus.bus.outlet import Admission, Outlet, TapOffer
from actbus.capture.requests import caller_request_id
from actbus.capture.scheduler import StepRequests
from actbus.monitor.graph import MonitorTables
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
            )

    def _retire(self, sr: StepRequests) -> list[RequestEnd]:
        ended = []
        for rid in sr.finished:
            st = self._reqs.pop(rid, None)
            if st is not None:
                ended.append(
                    RequestEnd(st.caller_id, st.sample_index, sr.reasons.get(rid, "unknown"))
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
        """Publish this step's scores (after the forward that wrote them)."""
        self._admit(sr)
        ended = self._retire(sr)
        parts: dict[tuple[int, str], list[tuple[_Request, np.ndarray, np.ndarray]]] = {}
        if host_pos is not None and self._reqs:
            for i, rid in enumerate(req_ids):
                st = self._reqs.get(rid)
                lo, hi = int(offsets[i]), int(offsets[i + 1])
                if st is None or hi == lo:
                    continue
                pos = host_pos[lo:hi]
                keep = pos >= st.next_pos  # recomputed after preemption: already published
                st.next_pos = max(st.next_pos, int(pos[-1]) + 1)
                if not keep.any():
                    continue
                rows = np.flatnonzero(keep) + lo
                for key in self.keys:
                    if key[1] in st.names:
                        parts.setdefault(key, []).append((st, pos[keep], rows))
        keys = [k for k in self.keys if k in parts or ended]
        if not keys:
            return
        offers = [
            TapOffer(
                k[0],
                MONITOR_HOOK,
                sum(len(p) for _, p, _ in parts.get(k, ()))
                * len(self.published[k[1]].cols)
                * SCORE_BYTES,
                bool(ended) or any(st.returns for st, _, _ in parts.get(k, ())),
            )
            for k in keys
        ]
        for key, verdict in zip(keys, publisher.admit(step, offers), strict=True):
            entries = parts.get(key, [])
            width = len(self.published[key[1]].cols)
            if verdict is Admission.DROP:  # no copy: counted as a drop by the bus
                header = self._header(step, key, 0, width, RowIndex.empty(), ended)
                header.shape = (sum(len(p) for _, p, _ in entries), width)
                publisher.drop(header)
            if verdict is not Admission.SEND:
                continue
            scores, toks = self._gather(key, entries, token_ids)
            (scores, toks), ready = to_host([scores, toks])
            rows = _row_index(entries, toks)
            publisher.publish(
                self._header(step, key, len(rows.positions), width, rows, ended),
                scores,
                ready=ready,
            )

    def _gather(self, key, entries, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``[rows, width]`` scores and ``[rows]`` token ids of ``entries``."""
        layer, name = key
        pt = self.tables.points[(layer, self.keys[key])]
        cols = self._index.get(key)
        if cols is None:
            seg = pt.segments[name]
            cols = self._index[key] = torch.from_numpy(self.published[name].cols + seg.lo).to(
                pt.scores.device
            )
        if not entries:
            return pt.scores.new_zeros((0, len(cols))), token_ids[:0].clone()
        idx = torch.from_numpy(np.concatenate([r for _, _, r in entries])).to(
            pt.scores.device, non_blocking=True
        )
        return pt.scores.index_select(0, idx).index_select(1, cols), token_ids.index_select(0, idx)

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


def _row_index(entries, toks: torch.Tensor) -> RowIndex:
    counts = [len(p) for _, p, _ in entries]
    tags = [st.tags for st, _, _ in entries]
    returned = [st.returns for st, _, _ in entries]
    return RowIndex(
        request_ids=[st.caller_id for st, _, _ in entries],
        offsets=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
        positions=(
            np.concatenate([p for _, p, _ in entries]) if entries else np.zeros(0, dtype=np.int64)
        ),
        token_ids=toks.numpy(),
        sample_index=[st.sample_index for st, _, _ in entries],
        tags=tags if any(tags) else [],
        returned=returned if any(returned) else [],
    )
