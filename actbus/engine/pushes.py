"""Live pushes in the engine: the push endpoint beside the scheduler, and dispatch.

Wraps the scheduler's ``__init__`` so an engine core whose actbus config has
``control`` (and monitors or live steering vectors) binds its push endpoint
(``actbus.bus.control``) as it starts: a bad address or key fails the start. The
scheduler's ``schedule`` (``actbus.engine.scheduler``) hands the endpoint's pending
pushes to the workers with the next step that runs a forward, and ``dispatch`` hands
each worker's share to the feature it changes (monitor weights to the monitor tables,
live vectors to the steerer) before that step's requests are admitted.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
from typing import Any

from actbus.bus.control import ControlServer
from actbus.bus.endpoints import for_rank
from actbus.bus.pushwire import Push, Slot
from actbus.engine import closing
from actbus.engine.dataparallel import worker_rank
from actbus.engine.parts import EngineParts
from actbus.engine.scheduler import PUSH_ATTR
from actbus.engine.session import capture_config, monitor_weights, num_layers
from actbus.monitor.push import apply_monitor_pushes
from actbus.steer.live import apply_vector_pushes


def patch() -> bool:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    if getattr(Scheduler, "_actbus_control_patched", False):
        return True
    Scheduler.__init__ = _wrap_init(Scheduler.__init__)
    Scheduler._actbus_control_patched = True
    return True


def _wrap_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        self._actbus_control = start_control(getattr(self, "vllm_config", None))

    return __init__


def start_control(vllm_config: Any) -> ControlServer | None:
    """This engine core's endpoint, bound; None without ``actbus.control``."""
    cfg = capture_config(vllm_config) if vllm_config is not None else None
    if cfg is None or cfg.control is None:
        return None
    mc = vllm_config.model_config
    hidden = mc.get_hidden_size()
    weights = (
        monitor_weights(cfg.monitor, num_layers(mc), hidden) if cfg.monitor is not None else {}
    )
    live = dict.fromkeys(cfg.steer.live, hidden) if cfg.steer is not None else {}
    if not weights and not live:
        return None
    # The engine core's own rank: vLLM resets data_parallel_rank to 0 in every core of a
    # dense model, so each rank would bind rank 0's address (and the others none).
    rank = worker_rank(vllm_config)
    control = dataclasses.replace(
        cfg.control, address=for_rank(cfg.control.address, rank, "actbus.control.address")
    )
    slots = {n: Slot(w.cols, int(w.weight.shape[1]), w.activation) for n, w in weights.items()}
    server = ControlServer(control, slots, {n: 1 for n in weights}, live)
    atexit.register(server.close)
    closing.on_shutdown(vllm_config, server.close)
    return server


def dispatch(parts: EngineParts, scheduler_output: Any) -> None:
    """Hand this step's pushes to the features on this rank (``parts``: what the runner
    holds), before the step's forward is launched and before its requests
    are admitted. Every rank gets the same ``SchedulerOutput``, so every rank that
    holds tables (the harvest's on tensor-parallel rank 0, the gates' on every rank)
    changes them at the same step."""
    pushes: list[Push] | None = getattr(scheduler_output, PUSH_ATTR, None)
    if not pushes:
        return
    step = parts.capture.step if parts.capture is not None else "?"
    if parts.steer is not None:
        apply_vector_pushes(parts.steer, [p for p in pushes if p.kind == "vector"], step)
    if parts.monitor_tables is not None:
        apply_monitor_pushes(parts.monitor_tables, [p for p in pushes if p.kind == "monitor"], step)
