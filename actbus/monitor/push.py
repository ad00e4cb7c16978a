"""Live weight pushes into a serving engine's monitors: how a worker applies them.

A push (``actbus.bus.pushwire``) replaces one monitor's weights with the same folded
form a checkpoint loads into (``actbus.monitor.weights``), so pushed and
checkpoint-loaded weights score alike. Only values change: the monitor's points,
activation, columns and TopK ``k`` shape the compiled graph and stay as the engine
started.

Path of a push: the engine core's control endpoint (``actbus.bus.control``, started
by ``actbus.engine.pushes``) checks it and keeps it pending; the scheduler puts the
pending pushes on the next ``SchedulerOutput`` that runs a forward, so
every worker gets them with that step, and the worker writes them into the back slot
of its double-buffered tables and flips them before launching that step's forward
(``apply_monitor_pushes``, ``actbus.monitor.swap``): that step and the ones after read
entirely the new weights, the ones before entirely the old. The monitor's version
changes at the same point, so every score message names the weights that made it.
"""

from __future__ import annotations

import logging
import time

from actbus.bus.pushwire import Push
from actbus.monitor.graph import MonitorTables
from actbus.monitor.swap import TableSwap
from actbus.monitor.weights import MonitorWeights

log = logging.getLogger("actbus.monitor")


def apply_monitor_pushes(tables: MonitorTables, pushes: list[Push], step: int | str) -> None:
    """Swap this step's monitor pushes into this rank's tables; called by the engine
    (``actbus.engine.pushes.dispatch``) before the step's forward is launched, on every
    rank that holds tables. A monitor whose layers are on another pipeline stage has
    nothing to write here."""
    if not pushes:
        return
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
