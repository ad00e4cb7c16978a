"""The vLLM internals actbus reads, checked before capture starts and after its first steps.

actbus reads runner and scheduler internals (``runner_v1.py``, ``runner_v2.py``,
``scheduler.py``, ``session.py``) that vLLM may change in any release. Rather than
capture rows against a layout it no longer understands, actbus checks every name it
reads: the shared scheduler side when the engine config is built (front end), each
runner's when that runner loads its model (worker), and fails with
``VllmVersionError`` naming the vLLM version and what is missing. After that,
``actbus.steps.StepGuard`` checks cheap invariants on the first real steps (rows per
request equal the tokens the scheduler gave it), since a name can stay while its
meaning changes.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from actbus.errors import VllmVersionError

# What each piece of vLLM must offer, as actbus reads it. A dotted name is read off the
# value of its first part.
SCHEDULER_OUTPUT = (
    "scheduled_new_reqs",
    "scheduled_cached_reqs",
    "num_scheduled_tokens",
    "total_num_scheduled_tokens",
    "finished_req_ids",
)
NEW_REQUEST = (
    "req_id",
    "prompt_token_ids",
    "prompt_embeds",
    "sampling_params",
    "num_computed_tokens",
)
CACHED_REQUESTS = ("req_ids", "num_computed_tokens")
SCHEDULER_METHODS = {"_free_request": ("request",), "schedule": ()}
RUNNER_METHODS = {
    # execute_model's positional parameters after self, as the wrappers read them.
    "v1": {"load_model": (), "execute_model": ("scheduler_output",)},
    "v2": {
        "load_model": (),
        "execute_model": ("scheduler_output", "intermediate_tensors", "dummy_run"),
    },
}
STEER_METHODS = {  # where the steering tables are filled, once the batch is laid out
    "v1": {"_prepare_inputs": ("scheduler_output",)},
    "v2": {"prepare_inputs": ("scheduler_output",)},
}
RUNNER_ATTRS = {  # on the runner instance, before load_model runs
    "v1": (
        "vllm_config",
        "max_num_tokens",
        "device",
        "input_batch.num_reqs",
        "input_batch.req_ids",
        "query_start_loc.cpu",
        "positions",
        "input_ids.gpu",
    ),
    # V2's execute_model_state is read after each step (runner_v2.py checks it there).
    "v2": ("vllm_config", "max_num_tokens", "device"),
}
V2_INPUT_BATCH = (
    "req_ids",
    "num_reqs",
    "num_tokens",
    "query_start_loc_np",
    "positions",
    "input_ids",
)


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def require(problems: list[str], where: str) -> None:
    """Raise ``VllmVersionError`` listing ``problems``, if any."""
    if problems:
        raise VllmVersionError(
            f"actbus: vLLM {vllm_version()} does not have what actbus reads in {where}: "
            + "; ".join(problems)
            + ". Capture is refused rather than risk wrong rows: use a vLLM version "
            "listed as tested in actbus's README, or drop the actbus entry of "
            "additional_config to serve without capture"
        )


def _names(cls: type) -> set[str]:
    """Fields, annotations and class attributes of ``cls`` (a dataclass or not)."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in getattr(cls, "__mro__", (cls,)):
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def missing_fields(cls: type, fields: tuple[str, ...]) -> list[str]:
    have = _names(cls)
    return [f"{cls.__qualname__}.{f} is gone" for f in fields if f not in have]


def signature_problems(cls: type, methods: dict[str, tuple[str, ...]]) -> list[str]:
    """Missing methods, or methods whose leading parameters are not the ones read."""
    out = []
    for name, params in methods.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            out.append(f"{cls.__qualname__}.{name} is gone")
            continue
        fn = inspect.unwrap(fn)  # actbus's own wrappers keep the signature underneath
        try:
            got = list(inspect.signature(fn).parameters)[1 : 1 + len(params)]
        except (TypeError, ValueError):
            continue  # no introspectable signature: nothing to compare
        if tuple(got) != params:
            out.append(
                f"{cls.__qualname__}.{name} takes ({', '.join(got)}) where actbus reads "
                f"({', '.join(params)})"
            )
    return out


def missing_attrs(obj: Any, attrs: tuple[str, ...], label: str) -> list[str]:
    out = []
    for dotted in attrs:
        value, parts = obj, dotted.split(".")
        for i, part in enumerate(parts):
            if not hasattr(value, part):
                out.append(f"{label}.{'.'.join(parts[: i + 1])} is gone")
                break
            value = getattr(value, part)
    return out


def scheduler_problems() -> list[str]:
    """The scheduler side both runners share (``scheduler.py``)."""
    try:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as e:
        return [f"vLLM's V1 scheduler does not import ({e})"]
    return (
        missing_fields(SchedulerOutput, SCHEDULER_OUTPUT)
        + missing_fields(NewRequestData, NEW_REQUEST)
        + missing_fields(CachedRequestData, CACHED_REQUESTS)
        + signature_problems(Scheduler, SCHEDULER_METHODS)
    )


def steer_problems() -> list[str]:
    """What steering reads of the engine core: the prefix cache's block hashes (salted
    where steered KV lies, ``kvsalt.py``) and the waiting queue (a request waits there
    for its table rows, ``steer_rows.py``)."""
    from actbus.engine import kvsalt

    try:
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.sched.request_queue import RequestQueue
    except ImportError as e:
        return [f"vLLM's prefix cache or request queue does not import ({e})"]
    out = [
        f"RequestQueue.{m} is gone"
        for m in ("add_request", "remove_requests")
        if not callable(getattr(RequestQueue, m, None))
    ]
    fn = getattr(kv_cache_utils, kvsalt.FUNCTION, None)
    if not callable(fn):
        return [*out, f"kv_cache_utils.{kvsalt.FUNCTION} is gone"]
    try:
        got = tuple(inspect.signature(inspect.unwrap(fn)).parameters)[: len(kvsalt.PARAMS)]
    except (TypeError, ValueError):
        return out
    if got != kvsalt.PARAMS:
        out.append(
            f"kv_cache_utils.{kvsalt.FUNCTION} takes {got} where actbus reads {kvsalt.PARAMS}"
        )
    return out


def runner_class_problems(runner: str, cls: type) -> list[str]:
    """A runner class's methods, and for V2 its per-step ``InputBatch``."""
    out = signature_problems(cls, RUNNER_METHODS[runner])
    if runner == "v2":
        try:
            from vllm.v1.worker.gpu.input_batch import InputBatch
        except ImportError as e:
            return [*out, f"vllm.v1.worker.gpu.input_batch.InputBatch does not import ({e})"]
        out += missing_fields(InputBatch, V2_INPUT_BATCH)
    return out


def runner_problems(runner: str, obj: Any) -> list[str]:
    """A runner instance about to load its model: its class, its attributes, and
    whether its ``execute_model`` is the one actbus wrapped (a subclass overriding it
    would run without capture, silently)."""
    cls = type(obj)
    out = runner_class_problems(runner, cls)
    out += missing_attrs(obj, RUNNER_ATTRS[runner], f"{cls.__qualname__}({runner})")
    if runner == "v1" and not hasattr(type(getattr(obj, "positions", [])), "__getitem__"):
        out.append(f"{cls.__qualname__}.positions is no longer a tensor")
    execute = getattr(cls, "execute_model", None)
    if execute is not None and not getattr(execute, "_actbus_wrapper", False):
        out.append(
            f"{cls.__module__}.{cls.__qualname__}.execute_model overrides the method "
            "actbus wraps, so no step would be captured"
        )
    return out
