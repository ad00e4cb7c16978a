"""Engine-core side of each step: why each request ended, and the pushes it carries.

The worker learns that a request left the batch (``finished_req_ids``) but not
why. The scheduler knows: it wrapped here to note each freed request's status
and to hand the reasons to the workers on the next ``SchedulerOutput`` (an extra
attribute; the output travels to workers pickled or in-process, both keep it).
An aborted request's rows are then marked partial downstream.

The scheduler also counts the steering table's rows (``actbus.engine.steer_rows``) and
keeps a steered request waiting while its rows do not fit.
"""

from __future__ import annotations

import functools
from typing import Any

from actbus.engine.steer_rows import RowBudget, requeue
from actbus.steps import StepRequests

ATTR = "_actbus_end_reasons"
PUSH_ATTR = "_actbus_pushes"
"""The ``SchedulerOutput`` attribute carrying a step's pushes to the workers."""
_REASONS = {
    "FINISHED_STOPPED": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "ignored",
    "FINISHED_ERROR": "error",
    "FINISHED_REPETITION": "stop",
}


def patch() -> bool:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    if getattr(Scheduler, "_actbus_patched", False):
        return True
    Scheduler._free_request = _wrap_free_request(Scheduler._free_request)
    Scheduler.schedule = _wrap_schedule(Scheduler.schedule)
    Scheduler._actbus_patched = True
    return True


def end_reasons(scheduler_output: Any) -> dict[str, str]:
    """Internal request id -> reason, for the requests that ended before this step."""
    return getattr(scheduler_output, ATTR, None) or {}


def _active(scheduler: Any) -> bool:
    cached = getattr(scheduler, "_actbus_active", None)
    if cached is None:
        extra = getattr(getattr(scheduler, "vllm_config", None), "additional_config", None)
        cached = scheduler._actbus_active = isinstance(extra, dict) and "actbus" in extra
    return cached


def _row_budget(scheduler: Any) -> RowBudget | None:
    """The scheduler's count of the steering table's rows; None: the engine does not steer."""
    if "_actbus_rows" not in scheduler.__dict__:
        budget = None
        if _active(scheduler):
            from actbus.engine.session import _checked, max_num_seqs

            checked = _checked(scheduler.vllm_config)
            steer = checked[0].steer if checked is not None else None
            if steer is not None:
                budget = RowBudget(steer.table_rows(max_num_seqs(scheduler.vllm_config)) - 1)
        scheduler._actbus_rows = budget
    return scheduler._actbus_rows


def _wrap_free_request(orig):
    @functools.wraps(orig)
    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _active(self):
            status = getattr(request.status, "name", str(request.status))
            self.__dict__.setdefault("_actbus_ended", {})[request.request_id] = _REASONS.get(
                status, "unknown"
            )
            budget = _row_budget(self)
            if budget is not None:
                budget.release(request.request_id)
        return orig(self, request, *args, **kwargs)

    return _free_request


def _wrap_schedule(orig):
    @functools.wraps(orig)
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        budget = _row_budget(self) if _active(self) else None
        waiting = list(self.waiting) if budget is not None and self.waiting else []
        held = budget.hold_back(waiting) if waiting else []
        if held:  # out of this step's reach: scheduled once their rows fit
            self.waiting.remove_requests(held)
        try:
            out = orig(self, *args, **kwargs)
        finally:
            if held:
                requeue(self.waiting, waiting, held)
        if budget is not None:
            budget.scheduled(out.scheduled_new_reqs)
        ended = self.__dict__.get("_actbus_ended")
        if ended:
            setattr(out, ATTR, {r: ended.pop(r) for r in out.finished_req_ids if r in ended})
        control = self.__dict__.get("_actbus_control")  # actbus.engine.pushes
        if control is not None and out.total_num_scheduled_tokens:  # a step with a forward
            pushes = control.take()
            if pushes:
                setattr(out, PUSH_ATTR, pushes)
        return out

    return schedule


def read_step(scheduler_output: Any) -> StepRequests:
    """The request facts of a ``SchedulerOutput`` (the same class for both runners)."""
    new = []
    starts: dict[str, int] = {}
    for r in scheduler_output.scheduled_new_reqs:
        sp = r.sampling_params
        extra = getattr(sp, "extra_args", None) if sp is not None else None
        wire = extra.get("actbus") if isinstance(extra, dict) else None
        prompt = r.prompt_token_ids
        n_prompt = len(prompt) if prompt is not None else int(r.prompt_embeds.shape[0])
        new.append((r.req_id, n_prompt, wire if isinstance(wire, dict) else None))
        starts[r.req_id] = int(r.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        starts[rid] = int(n)
    return StepRequests(
        new=new,
        starts=starts,
        finished=set(scheduler_output.finished_req_ids),
        reasons=end_reasons(scheduler_output),
        scheduled=scheduler_output.num_scheduled_tokens,
        total=int(scheduler_output.total_num_scheduled_tokens),
    )
