"""vLLM general plugin: registered through the ``vllm.general_plugins`` entry point.

vLLM calls ``register`` in every process it starts. It wraps the model runners'
model loading and step methods and the engine-config builder; all of them do
nothing unless ``additional_config`` holds an ``actbus`` entry.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("actbus")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from actbus.engine import frontend, kvsalt, pushes, runner_v1, runner_v2, scheduler, session

    patched = [name for name, mod in (("v1", runner_v1), ("v2", runner_v2)) if mod.patch()]
    if not patched:
        log.warning("actbus: no supported vLLM model runner found; capture is disabled")
    if not frontend.patch():
        log.warning("actbus: vLLM's InputProcessor not found; per-request selections are off")
    scheduler.patch()
    if not kvsalt.patch():  # an engine that steers is refused at start (internals)
        log.warning("actbus: vLLM's block hashes not found; steering cannot start")
    pushes.patch()
    session.patch_worker()
    _patch_engine_args()


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_actbus_patched", False):
        return
    orig = EngineArgs.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        from actbus.engine import mode
        from actbus.engine.session import validate

        requested = mode.Requested.of(self)  # before vLLM (or a plugin inside) changes it
        first = vars(EngineArgs).get("create_engine_config") is create_engine_config
        vllm_config = orig(self, *args, **kwargs)
        if validate(vllm_config) is not None:
            mode.check(vllm_config, requested, first=first)
        return vllm_config

    create_engine_config._actbus_wrapper = True
    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._actbus_patched = True
