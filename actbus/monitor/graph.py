"""What the compiled forward computes to monitor: scores of persistent weight tables.

Every monitored point (layer, hook) owns one table of the columns of every monitor
evaluated there (``weight [C, hidden]``, ``bias [C]``, ``theta [C]``, float32) and
one output buffer ``scores [max_rows, C]``. The point computes, for every token of
the batch, ``pre = stream @ weight.T + bias`` and each monitor's activation over its
own columns, and writes the result into ``scores`` with the tap op (a custom op that
mutates its output, so the compiler keeps it and a CUDA graph replays it).

The tables are double-buffered module buffers at fixed addresses: each holds two
slots (``weight [2, C, hidden]``, ``bias [2, C]``, ``theta [2, C]``) and the point's
``front [1]`` (int64, on the device) says which slot the forward reads. The graph
reads all of them as inputs, so new weights are written into the other slot and
``front`` is flipped (``actbus.monitor.swap``): never a recompile or a recapture, and
a forward reads one slot whole, so it never sees half an update. Reading the front
slot is a gather of ``C x hidden`` floats per forward (``C``: the point's columns,
a probe's 1 or an SAE's chosen features). Only the structure is fixed when the graph
is traced: which monitors sit at which columns, their activation and, for TopK,
``k``. The stream is read after steering at the same point, as capture reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from actbus import ops  # noqa: F401  (registers torch.ops.actbus.*)
from actbus.monitor.weights import MonitorWeights


@dataclass(frozen=True)
class Segment:
    """One monitor's columns at a point: ``[lo, hi)``, its activation and TopK's k."""

    lo: int
    hi: int
    activation: str
    k: int = 0


SLOTS = 2


@dataclass
class PointTable:
    weight: torch.Tensor  # [2, C, hidden] float32: two slots
    bias: torch.Tensor  # [2, C]
    theta: torch.Tensor  # [2, C]
    front: torch.Tensor  # [1] int64: the slot the forward reads
    scores: torch.Tensor  # [max_rows, C] float32
    segments: dict[str, Segment]  # monitor name -> its columns
    slot: int = 0
    """The host's copy of ``front``: the slot the last enqueued flip selected."""

    def read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The front slot's ``(weight, bias, theta)`` as the host sees them now."""
        return self.weight[self.slot], self.bias[self.slot], self.theta[self.slot]


@dataclass
class MonitorTables:
    """The device tables of one model, and the version of each monitor's weights."""

    points: dict[tuple[int, str], PointTable]
    versions: dict[str, int] = field(default_factory=dict)
    max_rows: int = 0

    swapper: object = None
    """``actbus.monitor.swap.TableSwap``, made on the first push."""

    def write(self, name: str, mw: MonitorWeights) -> int:
        """Copy ``name``'s weights into both slots of every point it is evaluated at;
        returns the new version (1 for the first). For the engine's start, before any
        forward: live pushes go through ``actbus.monitor.swap``."""
        w = torch.from_numpy(np.ascontiguousarray(mw.weight))
        b = torch.from_numpy(np.ascontiguousarray(mw.bias))
        t = torch.from_numpy(np.ascontiguousarray(mw.theta))
        for pt in self.points.values():
            seg = pt.segments.get(name)
            if seg is None:
                continue
            if seg.hi - seg.lo != mw.cols:
                raise ValueError(
                    f"monitor {name}: {mw.cols} columns, its table holds {seg.hi - seg.lo}"
                )
            pt.weight[:, seg.lo : seg.hi].copy_(w)
            pt.bias[:, seg.lo : seg.hi].copy_(b)
            pt.theta[:, seg.lo : seg.hi].copy_(t)
        self.versions[name] = self.versions.get(name, 0) + 1
        return self.versions[name]


def monitor_scores(
    stream: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    theta: torch.Tensor,
    segments: tuple[Segment, ...],
) -> torch.Tensor:
    """``[n, C]`` float32 scores of the ``n`` tokens of ``stream``."""
    pre = torch.nn.functional.linear(stream.float(), weight, bias)
    parts = []
    for s in segments:
        p = pre[:, s.lo : s.hi]
        if s.activation == "sigmoid":
            p = torch.sigmoid(p)
        elif s.activation == "relu":
            p = torch.relu(p)
        elif s.activation == "jumprelu":
            p = p * (p > theta[s.lo : s.hi]).to(p.dtype)
        elif s.activation == "topk":
            r = torch.relu(p)
            kth = torch.topk(r, s.k, dim=-1).values[:, -1:]
            p = r * (r >= kth).to(r.dtype)
        parts.append(p)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def front_slot(table: torch.Tensor, front: torch.Tensor) -> torch.Tensor:
    """``table[front]`` read on the device (no host sync, so a CUDA graph replays it
    reading whatever ``front`` holds then)."""
    return table.index_select(0, front).squeeze(0)


def monitor_point(layer: nn.Module, hook: str, stream: torch.Tensor) -> None:
    """Score ``stream`` at ``(layer, hook)`` into that point's output buffer, with the
    weights of the slot ``front`` selects."""
    segments = layer._actbus_monitor[hook]
    front = getattr(layer, f"_actbus_mon_{hook}_front")
    scores = monitor_scores(
        stream,
        front_slot(getattr(layer, f"_actbus_mon_{hook}_weight"), front),
        front_slot(getattr(layer, f"_actbus_mon_{hook}_bias"), front),
        front_slot(getattr(layer, f"_actbus_mon_{hook}_theta"), front),
        segments,
    )
    torch.ops.actbus.tap_copy(getattr(layer, f"_actbus_mon_{hook}_scores"), scores)


def install_monitors(
    decoder: nn.ModuleList,
    weights: dict[str, MonitorWeights],
    points: dict[str, list[tuple[int, str]]],
    *,
    hidden_size: int,
    max_rows: int,
    device: torch.device,
) -> MonitorTables:
    """Register each point's table on its layer (``points``: monitor name -> the
    points this rank holds) and write every monitor's weights (version 1). The layer's
    forward is wrapped by ``actbus.engine.layers.wrap_layer``, which reads
    ``_actbus_monitor``."""
    by_point: dict[tuple[int, str], list[str]] = {}
    for name, pts in points.items():
        for p in pts:
            by_point.setdefault(p, []).append(name)
    tables = MonitorTables({}, max_rows=max_rows)
    for (layer_idx, hook), names in sorted(by_point.items()):
        segs: dict[str, Segment] = {}
        lo = 0
        for name in names:
            mw = weights[name]
            segs[name] = Segment(lo, lo + mw.cols, mw.activation, mw.k)
            lo += mw.cols
        f32 = {"dtype": torch.float32, "device": device}
        pt = PointTable(
            torch.zeros(SLOTS, lo, hidden_size, **f32),
            torch.zeros(SLOTS, lo, **f32),
            torch.zeros(SLOTS, lo, **f32),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(max_rows, lo, **f32),
            segs,
        )
        layer = decoder[layer_idx]
        for what in ("weight", "bias", "theta", "front", "scores"):
            layer.register_buffer(f"_actbus_mon_{hook}_{what}", getattr(pt, what), persistent=False)
        mon = dict(getattr(layer, "_actbus_monitor", {}))
        mon[hook] = tuple(segs.values())
        layer._actbus_monitor = mon
        tables.points[(layer_idx, hook)] = pt
    for name in points:
        tables.write(name, weights[name])
    return tables
