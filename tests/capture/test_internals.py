"""The version guard: the vLLM internals actbus reads are checked at engine start, and
the first steps' layout after it (a real engine start failing is in test_engine_mode)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from actbus import steps
from actbus.engine import internals
from actbus.errors import VllmVersionError
from actbus.steps import StepRequests, StepView


def test_what_actbus_reads_is_there_on_this_vllm():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert internals.scheduler_problems() == []
    assert internals.runner_class_problems("v1", GPUModelRunner) == []
    assert internals.runner_class_problems("v1", CPUModelRunner) == []
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception:  # this build has no V2 runner (it needs Triton)
        return
    assert internals.runner_class_problems("v2", V2Runner) == []


def test_a_missing_scheduler_method_fails_the_engine_config(tiny_models, monkeypatch):
    """Checked when the config is built, before any engine process starts."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler

    import actbus.engine.plugin

    actbus.engine.plugin.register()
    monkeypatch.delattr(Scheduler, "_free_request")
    args = EngineArgs(
        model=str(tiny_models["llama"]),
        dtype="float32",
        additional_config={"actbus": {"layers": [1]}},
    )
    with pytest.raises(VllmVersionError) as e:
        args.create_engine_config()
    assert f"vLLM {vllm.__version__} does not have what actbus reads" in str(e.value)
    assert "Scheduler._free_request is gone" in str(e.value)


def test_a_changed_signature_is_named():
    class Runner:
        def execute_model(self, batch, intermediate_tensors=None, dummy_run=False):
            pass

        def load_model(self):
            pass

    got = internals.signature_problems(Runner, internals.RUNNER_METHODS["v1"])
    assert got == [
        "test_a_changed_signature_is_named.<locals>.Runner.execute_model takes (batch) "
        "where actbus reads (scheduler_output)"
    ]


def test_a_runner_that_overrides_execute_model_is_refused():
    """A subclass's own execute_model would run with no capture at all: refused."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import actbus.engine.plugin

    actbus.engine.plugin.register()

    class OwnStep(GPUModelRunner):
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return super().execute_model(scheduler_output, intermediate_tensors)

    problems = internals.runner_problems("v1", OwnStep.__new__(OwnStep))
    assert any("OwnStep.execute_model overrides the method actbus wraps" in p for p in problems)
    plain = internals.runner_problems("v1", GPUModelRunner.__new__(GPUModelRunner))
    assert not any("overrides" in p for p in plain)


def _view(req_ids, offsets, positions, *, scheduled, starts, total=None) -> StepView:
    offsets = np.asarray(offsets, dtype=np.int64)
    sr = StepRequests(
        new=[],
        starts=starts,
        finished=set(),
        reasons={},
        scheduled=scheduled,
        total=int(offsets[-1]) if total is None else total,
    )
    pos = torch.tensor(positions, dtype=torch.int64)
    return StepView(list(req_ids), offsets, pos, torch.zeros_like(pos), sr)


def test_step_guard_passes_a_consistent_step_and_checks_only_the_first():
    guard = steps.StepGuard()
    for _ in range(steps.CHECKED_STEPS):
        view = _view(["a", "b"], [0, 3, 4], [0, 1, 2, 7], scheduled={"a": 3, "b": 1},
                     starts={"a": 0, "b": 7})  # fmt: skip
        assert guard.check(view)
        guard.check_positions(view, np.array([0, 1, 2, 7]))
    assert not guard.check(view)  # later steps: only the total is compared


@pytest.mark.parametrize(
    "view, needle",
    [
        (
            _view(["a"], [0, 3], [0, 1, 2], scheduled={"a": 3}, starts={"a": 0}, total=4),
            "the runner laid out 3 rows, the scheduler scheduled 4 tokens",
        ),
        (
            _view(["a", "b"], [0, 2, 4], [0, 1, 7, 8], scheduled={"a": 3, "b": 1},
                  starts={"a": 0, "b": 7}),
            "rows per request {'a': 2, 'b': 2} differ from tokens scheduled {'a': 3, 'b': 1}",
        ),
        (
            _view(["a"], [0, 2], [5, 6], scheduled={"a": 2}, starts={}),
            "requests ['a'] ran with no first position from the scheduler",
        ),
    ],
)  # fmt: skip
def test_step_guard_names_the_broken_invariant(view, needle):
    with pytest.raises(VllmVersionError, match="a step broke an invariant") as e:
        steps.StepGuard().check(view)
    assert needle in str(e.value)


def test_step_guard_compares_device_positions():
    view = _view(["a"], [0, 3], [4, 5, 7], scheduled={"a": 3}, starts={"a": 4})
    guard = steps.StepGuard()
    assert guard.check(view)
    with pytest.raises(VllmVersionError, match="position of row 2 is 7 on the device, 6 as"):
        guard.check_positions(view, np.array([4, 5, 6]))


def test_a_broken_step_stops_capture_not_the_engine(tmp_path, caplog):
    """A real capture worker and publisher: the broken step is logged and counted, the
    publisher closes, and later steps are ignored rather than raising into vLLM."""
    from actbus.capture.taps import TapSet
    from actbus.capture.worker import CaptureWorker
    from actbus.config import CaptureConfig

    cfg = CaptureConfig.from_dict({"layers": [0], "publish": f"ipc://{tmp_path}/bus.sock"})
    taps = TapSet({(0, "post_block"): torch.zeros(8, 4)}, 4, torch.float32, 8, torch.device("cpu"))
    worker = CaptureWorker(cfg, taps, "m")
    broken = _view(["a"], [0, 2], [0, 1], scheduled={"a": 3}, starts={"a": 0}, total=2)
    with caplog.at_level(logging.ERROR, logger="actbus.capture"):
        worker.on_step(broken)
        worker.on_step(broken)
    assert worker.invariant_failures == 1
    assert "rows per request {'a': 2} differ from tokens scheduled {'a': 3}" in worker.stopped
    (record,) = [r for r in caplog.records if "Capture is stopped" in r.getMessage()]
    assert "invariant failures: 1" in record.getMessage()


def test_a_worker_with_a_runner_actbus_does_not_wrap_fails_at_start(tiny_models):
    """A runner of another class would serve without capture: refused before loading."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    import actbus.engine.plugin

    actbus.engine.plugin.register()

    class OwnLoad(GPUModelRunner):
        def load_model(self, *args, **kwargs):
            raise AssertionError("the check comes first")

    worker = Worker.__new__(Worker)
    worker.vllm_config = EngineArgs(
        model=str(tiny_models["llama"]),
        dtype="float32",
        additional_config={"actbus": {"layers": [1]}},
    ).create_engine_config()
    worker.model_runner = OwnLoad.__new__(OwnLoad)
    with pytest.raises(VllmVersionError, match=r"OwnLoad, a model runner actbus does not"):
        worker.load_model()
