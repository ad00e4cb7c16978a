"""Adapter for vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``).

V2 builds an ``InputBatch`` per step and keeps it in ``execute_model_state``
until ``sample_tokens`` clears it, so the batch layout is read right after
``execute_model`` returns; steering tables are filled from the ``InputBatch`` that
``prepare_inputs`` returns, before the forward. Dummy runs (profiling, warm-up, graph capture) are
skipped. Every touch of V2 internals is in this file; what happens around the
forward is ``actbus.engine.steploop``'s.
"""

from __future__ import annotations

import functools
from typing import Any

from actbus.engine.internals import vllm_version
from actbus.engine.session import wrap_load_model
from actbus.engine.steploop import fill_steering, wrap_execute_model
from actbus.errors import VllmVersionError
from actbus.steps import StepRequests, StepView


def patch() -> bool:
    """Wrap the V2 runner's methods; False if this vLLM has no usable V2 runner."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # absent, or needs Triton/CUDA that this build lacks
        return False
    if getattr(GPUModelRunner, "_actbus_patched", False):
        return True
    GPUModelRunner.load_model = wrap_load_model(GPUModelRunner.load_model, "v2")
    GPUModelRunner.execute_model = wrap_execute_model(
        GPUModelRunner.execute_model, read_batch, _dummy
    )
    if hasattr(GPUModelRunner, "prepare_inputs"):  # where steering tables are filled
        GPUModelRunner.prepare_inputs = _wrap_prepare_inputs(GPUModelRunner.prepare_inputs)
        GPUModelRunner._actbus_steers = True
    GPUModelRunner._actbus_patched = True
    return True


def read_batch(runner: Any, requests: StepRequests, started: float) -> StepView | None:
    """The batch V2's forward just used: the ``InputBatch`` kept in
    ``execute_model_state`` until ``sample_tokens`` clears it."""
    if not hasattr(runner, "execute_model_state"):  # where this adapter reads the batch
        raise VllmVersionError(
            f"actbus: vLLM {vllm_version()}'s Model Runner V2 keeps no "
            "execute_model_state after execute_model; capture cannot read its batches"
        )
    ib = getattr(runner.execute_model_state, "input_batch", None)
    if ib is None or not ib.num_tokens:
        return None
    n = int(ib.num_tokens)
    return StepView(
        req_ids=list(ib.req_ids[: ib.num_reqs]),
        offsets=ib.query_start_loc_np[: ib.num_reqs + 1].astype("int64").copy(),
        positions=ib.positions[:n],
        token_ids=ib.input_ids[:n],
        requests=requests,
        started=started,
    )


def _dummy(args: tuple, kwargs: dict) -> bool:
    """``execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)``."""
    return bool(kwargs.get("dummy_run") or (len(args) >= 2 and args[1]))


def _wrap_prepare_inputs(orig):
    @functools.wraps(orig)
    def prepare_inputs(self, scheduler_output, *args: Any, **kwargs: Any) -> Any:
        ib = orig(self, scheduler_output, *args, **kwargs)
        fill_steering(
            self,
            list(ib.req_ids[: ib.num_reqs]),
            ib.query_start_loc_np[: ib.num_reqs + 1].astype("int64"),
        )
        return ib

    return prepare_inputs
