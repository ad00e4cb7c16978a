"""A second vLLM general plugin, installed for one subprocess as a real entry point.

It does what some plugins do to the engine config: wraps
``EngineArgs.create_engine_config`` and forces ``enforce_eager`` (``eager``), or, for the
version guard, takes an attribute actbus reads off the V1 runner (``drop=NAME``), as a
vLLM release that renamed it would. ``install_plugin`` writes the module and a
dist-info with its entry point into a folder to put on PYTHONPATH.
"""

from __future__ import annotations

from pathlib import Path

NAME = "meddler"
DIST = "meddler-plugin"

SOURCE = '''
"""Test plugin: changes vLLM the way some general plugins do (see tests/support/plugins.py)."""

import os

_orig = None


def register():
    global _orig
    if _orig is not None:
        return
    from vllm.engine.arg_utils import EngineArgs

    _orig = EngineArgs.create_engine_config
    what = os.environ.get("MEDDLER", "eager")
    if what == "eager":

        def create_engine_config(self, *args, **kwargs):
            self.enforce_eager = True
            return _orig(self, *args, **kwargs)

        EngineArgs.create_engine_config = create_engine_config
    elif what.startswith("drop="):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        name = what[len("drop="):]
        init = GPUModelRunner.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            setattr(self, "_moved_" + name, self.__dict__.pop(name))

        GPUModelRunner.__init__ = __init__
'''


def install_plugin(folder: Path) -> Path:
    """Write the plugin and its entry point into ``folder``; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{NAME}.py").write_text(SOURCE)
    info = folder / f"{DIST.replace('-', '_')}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{NAME} = {NAME}:register\n")
    return folder
