"""Adapter for vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``).

V2 builds an ``InputBatch`` per step and keeps it in ``execute_model_state``
until ``sample_tokens`` clears it, so the batch layout is read right after
``execute_model`` returns; steering tables are filled from the ``InputBatch`` that
``prepare_inputs`` returns, before the forward. Dummy runs (profiling, warm-up, graph capture) are
skipped. Every touch of V2 internals is in this file.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from actbus.capture.internals import vllm_version
from actbus.capture.scheduler import read_step
from actbus.capture.session import wrap_load_model
from actbus.capture.worker import StepView
from actbus.errors import VllmVersionError
from actbus.monitor.push import apply_pushes

_EMPTY = torch.zeros(0, dtype=torch.int64)


def patch() -> bool:
    """Wrap the V2 runner's methods; False if this vLLM has no usable V2 runner."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # absent, or needs Triton/CUDA that this build lacks
        return False
    if getattr(GPUModelRunner, "_actbus_patched", False):
        return True
    GPUModelRunner.load_model = wrap_load_model(GPUModelRunner.load_model, "v2")
    GPUModelRunner.execute_model = _wrap_execute_model(GPUModelRunner.execute_model)
    if hasattr(GPUModelRunner, "prepare_inputs"):  # where steering tables are filled
        GPUModelRunner.prepare_inputs = _wrap_prepare_inputs(GPUModelRunner.prepare_inputs)
        GPUModelRunner._actbus_steers = True
    GPUModelRunner._actbus_patched = True
    return True


def _wrap_execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        dummy = kwargs.get("dummy_run") or (len(args) >= 2 and args[1])
        if not dummy:  # new monitor weights, before this step's forward
            apply_pushes(self, scheduler_output)
        steer = getattr(self, "_actbus_steer", None)
        requests = None
        if steer is not None and not dummy:  # filled in prepare_inputs, before the forward
            requests = self._actbus_requests = read_step(scheduler_output)
            steer.admit(requests)
        out = orig(self, scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        cap = getattr(self, "_actbus", None)
        if cap is None or dummy:
            return out
        requests = requests or read_step(scheduler_output)
        if not hasattr(self, "execute_model_state"):  # where this adapter reads the batch
            cap.fail(VllmVersionError(
                f"actbus: vLLM {vllm_version()}'s Model Runner V2 keeps no "
                "execute_model_state after execute_model; capture cannot read its batches"
            ))  # fmt: skip
            return out
        state = getattr(self, "execute_model_state", None)
        ib = getattr(state, "input_batch", None)
        if ib is None or not ib.num_tokens:  # nothing ran; maybe requests ended
            if requests.finished:
                cap.on_step(StepView([], np.zeros(1, np.int64), _EMPTY, _EMPTY, requests, started))
            return out
        n = int(ib.num_tokens)
        cap.on_step(
            StepView(
                req_ids=list(ib.req_ids[: ib.num_reqs]),
                offsets=ib.query_start_loc_np[: ib.num_reqs + 1].astype("int64").copy(),
                positions=ib.positions[:n],
                token_ids=ib.input_ids[:n],
                requests=requests,
                started=started,
            )
        )
        return out

    execute_model._actbus_wrapper = True  # the runner check looks for it
    return execute_model


def _wrap_prepare_inputs(orig):
    @functools.wraps(orig)
    def prepare_inputs(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        ib = orig(self, scheduler_output, *args, **kwargs)
        steer = getattr(self, "_actbus_steer", None)
        if steer is not None:
            steer.fill(
                list(ib.req_ids[: ib.num_reqs]),
                ib.query_start_loc_np[: ib.num_reqs + 1].astype("int64"),
                self._actbus_requests.starts,
            )
        return ib

    return prepare_inputs
