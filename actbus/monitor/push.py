"""Live weight pushes into a serving engine's monitors: how a worker applies them.

A push (``actbus.bus.pushwire``) replaces one monitor's weights with the same folded
form a checkpoint loads into (``actbus.monitor.weights``), so pushed and
checkpoint-loaded weights score alike. Only values change: the monitor's points,
activation, columns and TopK ``k`` shape the compiled graph and stay as the engine
started.

Path of a push: the engine core's control endpoint (``actbus.bus.control``, started
by ``actbus.capture.control``) checks it and keeps it pending; the scheduler puts the
pending pushes on the next ``SchedulerOutput`` that runs a forward (``PUSH_ATTR``), so
every worker gets them with that step, and the worker writes them into the back slot
of its double-buffered tables and flips them before launching that step's forward
(``apply_pushes``, ``actbus.monitor.swap``): that step and the ones after read
entirely the new weights, the ones before entirely the old. The monitor's version
changes at the same point, so every score message names the weights that made it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from actbus.bus.pushwire import Push
from actbus.monitor.graph import MonitorTables
from actbus.monitor.swap import TableSwap
from actbus.monitor.weights import MonitorWeights
from actbus.steer.live import apply_vector_pushes

log = logging.getLogger("actbus.monitor")

PUSH_ATTR = "_actbus_pushes"
"""The ``SchedulerOutput`` attribute carrying a step's pushes to the workers."""


def apply_pushes(runner: Any, scheduler_output: Any) -> None:
    """Swap this step's pushes into the runner's monitor tables (and hand live steering
    vectors' pushes to its steerer); called before the step's forward is launched and
    before its requests are admitted, on every rank. Every rank that holds tables writes
    them: tensor-parallel rank 0 for the scores' harvest, and every tensor-parallel
    rank when steering gates read the scores (each rank's gates read its own copy, so
    all must change at the same step: each rank gets the same ``SchedulerOutput``).
    A rank without tables (no gates, TP rank > 0) has nothing to write."""
    pushes: list[Push] | None = getattr(scheduler_output, PUSH_ATTR, None)
    if not pushes:
        return
    apply_vector_pushes(runner, [p for p in pushes if p.kind == "vector"])
    pushes = [p for p in pushes if p.kind == "monitor"]
    if not pushes:
        return
    tables: MonitorTables | None = getattr(runner, "_actbus_monitor_tables", None)
    if tables is None:
        return
    step = getattr(getattr(runner, "_actbus", None), "step", "?")
    updates: dict[str, MonitorWeights] = {}
    for p in pushes:
        segs = [pt.segments[p.name] for pt in tables.points.values() if p.name in pt.segments]
        if not segs:  # the monitor's layers are on another pipeline stage
            continue
        updates[p.name] = MonitorWeights(p.weight, p.bias, segs[0].activation, p.theta, k=segs[0].k)
    TableSwap.of(tables).swap(updates)
    for p in pushes:
        if p.name not in updates:
            continue
        tables.versions[p.name] = p.version  # the engine core numbered it
        log.info(
            "actbus: monitor %s version %d in use from step %s, %.1f ms after the push arrived",
            p.name, p.version, step, (time.time() - p.received) * 1e3,
        )  # fmt: skip
