"""How the engine runs: one line at start, and a warning when it is slower than asked.

actbus's cost figures assume torch.compile and CUDA graphs stay on. Another general
plugin can turn them off without a word (one that forces ``enforce_eager`` cut a 4-layer
capture run to half its speed), so when the engine config is built actbus compares the
compile and CUDA-graph modes with what the engine arguments asked for, and when they
are off unasked it warns, naming the plugin that wraps vLLM's config building where it
finds one. The worker logs the mode line once its taps are in (``mode_line``).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from actbus.streams import point_key

# Under vLLM's logger, so these lines follow VLLM_LOGGING_LEVEL and vLLM's format.
log = logging.getLogger("vllm.actbus")

PLUGIN_GROUP = "vllm.general_plugins"
_OURS = ("vllm", "actbus", "pydantic", "torch")  # whose functions are not a foreign cause
# Where another plugin would change the engine config: wrappers found here are named.
CONFIG_BUILDERS = (
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config"),
    ("vllm.engine.arg_utils", "EngineArgs", "__post_init__"),
    ("vllm.engine.arg_utils", "EngineArgs", "__init__"),
    ("vllm.config", "VllmConfig", "__post_init__"),
    ("vllm.config", "CompilationConfig", "__post_init__"),
    ("vllm.config", "ModelConfig", "__post_init__"),
)


@dataclass(frozen=True)
class Requested:
    """What the engine arguments asked for, read as they reach actbus."""

    enforce_eager: bool
    compile_mode: str | None  # None: left to vLLM
    cudagraph_mode: str | None

    @classmethod
    def of(cls, engine_args: Any) -> Requested:
        cc = getattr(engine_args, "compilation_config", None)
        get = cc.get if isinstance(cc, dict) else lambda k: getattr(cc, k, None)
        eager = bool(getattr(engine_args, "enforce_eager", False))
        return cls(eager, _name(get("mode")), _name(get("cudagraph_mode")))


def _name(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "name", value)).upper()


def modes(vllm_config: Any) -> tuple[str, str]:
    """(compile mode, CUDA-graph mode) of a built config, by name."""
    cc = vllm_config.compilation_config
    return _name(cc.mode) or "NONE", _name(cc.cudagraph_mode) or "NONE"


def mode_line(*, runner: str, vllm_config: Any, version: str, taps: list, device: Any) -> str:
    compile_mode, graphs = modes(vllm_config)
    keys = ", ".join(point_key(layer, hook) for layer, hook in taps)
    return (
        f"actbus: engine runs Model Runner {runner.upper()}, compile mode {compile_mode}, "
        f"CUDA graphs {graphs}, vLLM {version}, device {device}; "
        f"{len(taps)} taps installed: {keys}"
    )


def slowdown(vllm_config: Any, requested: Requested, graphs_possible: bool) -> list[str]:
    """What is off that the engine arguments did not turn off."""
    compile_mode, graphs = modes(vllm_config)
    off = []
    if compile_mode == "NONE" and not requested.enforce_eager and requested.compile_mode != "NONE":
        off.append("torch.compile (compile mode NONE)")
    if (
        graphs_possible
        and graphs == "NONE"
        and not requested.enforce_eager
        and requested.cudagraph_mode != "NONE"
    ):
        off.append("CUDA graphs (cudagraph mode NONE)")
    return off


def config_wrappers() -> list[tuple[str, str]]:
    """(what, module) for every function outside vLLM and actbus found on vLLM's
    config-building methods: the outer function, what it wraps (``__wrapped__``), and
    functions it keeps in its closure."""
    import importlib

    found = []
    for mod_name, cls_name, attr in CONFIG_BUILDERS:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        todo, seen = [vars(cls).get(attr)], set()
        while todo:
            fn = todo.pop()
            if not callable(fn) or id(fn) in seen:
                continue
            seen.add(id(fn))
            module = str(getattr(fn, "__module__", "") or "")
            top = module.split(".")[0]
            if top and top not in _OURS and top not in sys.stdlib_module_names:
                found.append((f"{cls_name}.{attr}", module))
            todo.append(getattr(fn, "__wrapped__", None))
            todo += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _full(c)]
    return found


def _full(cell: Any) -> bool:
    try:
        return callable(cell.cell_contents)
    except ValueError:  # an empty cell
        return False


def general_plugins() -> list[tuple[str, str, str]]:
    """(name, module, distribution) of the general plugins this process loads."""
    allowed = os.environ.get("VLLM_PLUGINS")
    names = None if allowed is None else {n.strip() for n in allowed.split(",")}
    out = []
    for ep in entry_points(group=PLUGIN_GROUP):
        if names is not None and ep.name not in names:
            continue
        dist = getattr(ep, "dist", None)
        label = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        out.append((ep.name, ep.value.split(":")[0], label))
    return out


def causes() -> list[str]:
    """The plugins (or settings) that turned compilation or graphs off, where found."""
    plugins = [p for p in general_plugins() if p[1].split(".")[0] not in _OURS]
    named = []
    for what, module in config_wrappers():
        top = module.split(".")[0]
        owner = next((p for p in plugins if p[1].split(".")[0] == top), None)
        who = f"general plugin {owner[0]!r} ({owner[2]})" if owner else f"module {module}"
        named.append(f"{who} wraps {what} ({module})")
    if os.environ.get("TORCH_COMPILE_DISABLE") == "1":
        named.append("TORCH_COMPILE_DISABLE=1 is set in the environment")
    if not named and plugins:
        named.append(
            "not found for certain; other general plugins loaded: "
            + ", ".join(f"{n!r} ({d})" for n, _, d in plugins)
        )
    return named


def check(vllm_config: Any, requested: Requested, *, first: bool = True) -> str | None:
    """Warn when compilation or CUDA graphs are off though not asked off; the warning.

    ``first``: actbus's wrapper was the outermost on ``create_engine_config``, so
    ``requested`` is what the caller passed. Otherwise a wrapper outside it may have
    changed the arguments already, and whatever is off is reported.
    """
    try:
        from vllm.platforms import current_platform

        graphs_possible = bool(current_platform.is_cuda_alike())
    except Exception:  # no platform: only compilation is judged
        graphs_possible = False
    judged = requested if first else Requested(False, None, None)
    off = slowdown(vllm_config, judged, graphs_possible)
    if not off:
        return None
    found = causes()
    asked = (
        "although the engine arguments did not ask for it "
        f"(enforce_eager={requested.enforce_eager})"
        if first
        else "and the engine arguments reached actbus through another wrapper, which may have "
        "changed them (ignore this if you asked for it)"
    )
    msg = (
        f"actbus: {' and '.join(off)} off {asked}; capture and serving run slower. Cause: "
        + ("; ".join(found) if found else "not found")
        + ". If that is not what you want, uninstall that plugin or name the plugins to load "
        "in VLLM_PLUGINS (for example VLLM_PLUGINS=actbus)"
    )
    log.warning(msg)
    return msg
