"""The engine's mode line, the warning that names a plugin forcing eager mode, and the
version guard failing a real engine start (each a real engine in its own process, with
a second general plugin installed through a real entry point)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.plugins import DIST, NAME, install_plugin
from tests.support.procs import ROOT


def _start(tmp_path: Path, model: Path, meddle: str) -> subprocess.CompletedProcess:
    plugins = install_plugin(tmp_path / "plugins")
    env = {
        **os.environ,
        # After actbus's entry points: the plugin loads after actbus, so its wrapper is the
        # outer one (tests/capture/test_mode.py covers the other order in-process).
        "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", str(ROOT)), str(plugins)]),
        "MEDDLER": meddle,
        "VLLM_LOGGING_LEVEL": "INFO",  # the mode line is INFO
        "VLLM_USE_V2_MODEL_RUNNER": "0",  # on a GPU too: the plugin's drop is on V1's runner
        # The engine in the script's own process, Dynamo only: a start of seconds. What is
        # under test (the plugins' hooks, the mode line, the guard) runs there as well.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_CI_ENV": "1",
    }
    env.pop("VLLM_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "tests.support.start_once", str(model), f"ipc://{tmp_path}/b"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=env,
    )


def test_warning_names_the_plugin_that_forced_eager(tiny_models, tmp_path):
    proc = _start(tmp_path, tiny_models["llama"], "eager")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "generated 4 tokens" in log
    warning = next((ln for ln in log.splitlines() if "actbus: torch.compile" in ln), "")
    assert "torch.compile (compile mode NONE) off" in warning, log[-4000:]
    assert f"general plugin {NAME!r} ({DIST} 0.1) wraps EngineArgs.create_engine_config" in warning
    assert "VLLM_PLUGINS" in warning
    # The worker's mode line: how it runs, as the config says (eager forced: no compile).
    assert "actbus: engine runs Model Runner V1, compile mode NONE, CUDA graphs NONE" in log
    assert "1 taps installed: L1.post_block" in log


def test_version_guard_fails_engine_start(tiny_models, tmp_path):
    """A runner attribute actbus reads is gone: the engine fails at start, naming it."""
    proc = _start(tmp_path, tiny_models["llama"], "drop=query_start_loc")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    assert "does not have what actbus reads in Model Runner V1" in log, log[-4000:]
    assert re.search(r"\b\w*ModelRunner\(v1\)\.query_start_loc is gone", log)  # CPU or GPU
    assert "generated" not in log
