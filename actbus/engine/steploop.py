"""The one step loop: what actbus does around each forward of a model runner.

Both runner adapters (``runner_v1``, ``runner_v2``) wrap their runner's
``execute_model`` with ``wrap_execute_model`` and differ only in how they read the
batch the forward used (``BatchReader``). In order, on every rank:

1. pushes: new monitor weights and live vectors (``actbus.engine.pushes.dispatch``);
2. admission: the step's request starts and ends reach the steerer, before the
   runner lays out the batch (its tables are filled from the layout, ``fill_steering``);
3. the forward;
4. capture: the batch's rows are published (``CaptureWorker.on_step``, rank 0);
5. monitor harvest: scores of the same rows, through capture's outlet
   (``CaptureWorker.harvests``).

What runs there is what ``actbus.engine.session`` attached to the runner
(``actbus.engine.parts.EngineParts``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from actbus.engine.parts import NO_PARTS, parts_of
from actbus.engine.pushes import dispatch
from actbus.engine.scheduler import read_step
from actbus.errors import VllmVersionError
from actbus.steps import StepRequests, StepView

_EMPTY = torch.zeros(0, dtype=torch.int64)

BatchReader = Callable[[Any, StepRequests, float], "StepView | None"]
"""Reads the batch a runner's forward just used: (runner, requests, started) ->
the step's view, or None when no tokens ran. May raise ``VllmVersionError``."""


def empty_view(requests: StepRequests, started: float) -> StepView:
    """A step that ran no tokens, only telling workers which requests ended."""
    return StepView([], np.zeros(1, np.int64), _EMPTY, _EMPTY, requests, started)


def run_step(
    runner: Any,
    scheduler_output: Any,
    forward: Callable[[], Any],
    read_batch: BatchReader,
    *,
    dummy: bool = False,
) -> Any:
    """Run one forward with actbus's work around it (the module docstring's order).
    A dummy run (profiling, warm-up, graph capture) only runs the forward."""
    parts = parts_of(runner)
    if dummy or parts is NO_PARTS:
        return forward()
    dispatch(parts, scheduler_output)
    requests = None
    if parts.steer is not None or parts.hooks is not None:
        requests = parts.requests = read_step(scheduler_output)
    if parts.steer is not None:
        parts.steer.admit(requests)
    if parts.hooks is not None:
        parts.hooks.admit(requests.new, requests.finished)
    try:
        out = forward()
    finally:
        if parts.hooks is not None:
            parts.hooks.done()
    started = time.perf_counter()
    cap = parts.capture
    if cap is None:
        return out
    requests = requests or read_step(scheduler_output)
    try:
        view = read_batch(runner, requests, started)
    except VllmVersionError as e:  # a vLLM whose layout changed: capture stops, not serving
        cap.fail(e)
        return out
    if view is None:  # nothing ran; maybe requests ended
        if requests.finished:
            cap.on_step(empty_view(requests, started))
        return out
    cap.on_step(view)
    return out


def wrap_execute_model(
    orig: Callable[..., Any],
    read_batch: BatchReader,
    is_dummy: Callable[[tuple, dict], bool] = lambda args, kwargs: False,
) -> Callable[..., Any]:
    """A runner's ``execute_model`` run through ``run_step``; ``is_dummy`` tells, from
    the call's other arguments, a run with no real requests."""

    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        return run_step(
            self,
            scheduler_output,
            lambda: orig(self, scheduler_output, *args, **kwargs),
            read_batch,
            dummy=is_dummy(args, kwargs),
        )

    execute_model._actbus_wrapper = True  # the runner check looks for it
    return execute_model


def fill_steering(runner: Any, req_ids: list[str], offsets: np.ndarray) -> None:
    """Fill this rank's steering tables from the batch layout the runner just made,
    before the forward (called from the adapters' input-preparation wrappers)."""
    parts = parts_of(runner)
    if parts.steer is not None and parts.requests is not None:
        parts.steer.fill(req_ids, offsets, parts.requests.starts)
    if parts.hooks is not None and parts.requests is not None:
        parts.hooks.fill(req_ids, offsets, parts.requests.starts)
