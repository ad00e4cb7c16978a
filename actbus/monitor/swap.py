"""Swapping new monitor weights into the double-buffered tables between steps.

Each monitor point's table has two slots and a device index ``front``
(``actbus.monitor.graph``). A swap writes the back slot (a copy of the front one with
the pushed monitors' columns replaced) and then flips ``front``; the compiled graph
and its CUDA graphs keep reading the same addresses. A forward reads ``front`` once
and the slot it names whole, so every step scores with entirely the old or entirely
the new weights.

On CUDA the back slot is written on a side stream from pinned memory, so the host
never waits and the copy overlaps the forward still running on the compute stream:

- the side stream first waits for ``freed[point]``, an event the compute stream
  recorded right after it last flipped away from that slot (when it fires, every
  forward that read the slot has run);
- the compute stream waits for the side stream's ``staged`` event, then flips
  ``front`` (a one-element fill, no host sync) before the step's forward, and records
  the new ``freed[point]``.

The host buffers stay referenced until their copies have run. On CPU everything runs
in order on the calling thread: the same writes, then the flip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from actbus.monitor.graph import MonitorTables, PointTable
from actbus.monitor.weights import MonitorWeights


@dataclass
class TableSwap:
    """Writes and flips one model's monitor tables; one per ``MonitorTables``."""

    tables: MonitorTables
    _side: torch.cuda.Stream | None = None
    _freed: dict[tuple[int, str], torch.cuda.Event] = field(default_factory=dict)
    _inflight: list[tuple[list[torch.Tensor], torch.cuda.Event]] = field(default_factory=list)

    @classmethod
    def of(cls, tables: MonitorTables) -> TableSwap:
        if tables.swapper is None:
            tables.swapper = cls(tables)
        return tables.swapper  # type: ignore[return-value]

    def swap(self, updates: dict[str, MonitorWeights]) -> list[tuple[int, str]]:
        """Put ``updates`` (monitor name -> new weights) in use from the next forward
        enqueued on this device; returns the points flipped."""
        points = [
            p for p, pt in self.tables.points.items() if any(n in pt.segments for n in updates)
        ]
        if not points:
            return []
        for p in points:
            for name, mw in updates.items():
                seg = self.tables.points[p].segments.get(name)
                if seg is not None and seg.hi - seg.lo != mw.cols:
                    raise ValueError(
                        f"monitor {name}: {mw.cols} columns, its table holds {seg.hi - seg.lo}"
                    )
        device = self.tables.points[points[0]].weight.device
        host = {n: _host(mw, device.type == "cuda") for n, mw in updates.items()}
        if device.type != "cuda":
            for p in points:
                pt = self.tables.points[p]
                back = 1 - pt.slot
                _stage(pt, back, host)
                pt.front.fill_(back)
                pt.slot = back
            return points
        main = torch.cuda.current_stream(device)
        if self._side is None:
            self._side = torch.cuda.Stream(device)
            self._side.wait_stream(main)  # the tables as the engine's start wrote them
        self._inflight = [(h, e) for h, e in self._inflight if not e.query()]
        with torch.cuda.stream(self._side):
            for p in points:
                freed = self._freed.get(p)
                if freed is not None:
                    self._side.wait_event(freed)
                _stage(self.tables.points[p], 1 - self.tables.points[p].slot, host)
            staged = torch.cuda.Event()
            staged.record(self._side)
        self._inflight.append(([t for ts in host.values() for t in ts], staged))
        main.wait_event(staged)
        for p in points:
            pt = self.tables.points[p]
            back = 1 - pt.slot
            pt.front.fill_(back)
            freed = torch.cuda.Event()
            freed.record(main)
            self._freed[p] = freed
            pt.slot = back
        return points


def _host(mw: MonitorWeights, pin: bool) -> list[torch.Tensor]:
    out = [
        torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        for a in (mw.weight, mw.bias, mw.theta)
    ]
    return [t.pin_memory() for t in out] if pin else out


def _stage(pt: PointTable, back: int, host: dict[str, list[torch.Tensor]]) -> None:
    """The back slot := the front slot, with the pushed monitors' columns replaced."""
    front = 1 - back
    nb = pt.weight.is_cuda
    for t in (pt.weight, pt.bias, pt.theta):
        t[back].copy_(t[front], non_blocking=nb)
    for name, (w, b, th) in host.items():
        seg = pt.segments.get(name)
        if seg is None:
            continue
        pt.weight[back, seg.lo : seg.hi].copy_(w, non_blocking=nb)
        pt.bias[back, seg.lo : seg.hi].copy_(b, non_blocking=nb)
        pt.theta[back, seg.lo : seg.hi].copy_(th, non_blocking=nb)
