"""User hooks: a Python callable at a decoder layer's hook point, per request.

What the built-in operations (``actbus.steer``) do not cover runs here: a callable
that reads a request's rows of the stream at one point, may return new rows (they
replace the stream there) and may save what it likes (``HookCall.saved``, back on
``Hook.saved[request id]``).

Design: the points an engine may hook are fixed at start (``actbus.user_hooks``:
``layers`` and ``points``); only there does the compiled graph get one custom op,
``actbus::user_hook``, which the compiler cannot see into, so it calls back into
Python at run time. Layers and points without it keep the graph exactly as it was;
a step with no hooked request pays one Python call per hooked point, which returns at
once. (Running hooked steps eagerly instead would need a second, uncompiled model
and a per-step switch inside vLLM's runner; the op keeps both out.)

Who may run code: an in-process ``LLM`` passes ``Hook`` objects (the caller's own
process runs them: only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where the worker
is in the caller's process); HTTP callers only select, by name, hooks the operator
installed as entry points of group ``actbus.hooks`` and listed in
``actbus.user_hooks.named``. No code is ever taken from a request.

Parameter access: ``HookCall.param(name)`` returns the engine's parameter, gathered
across tensor-parallel ranks where it is sharded (every rank runs the hook; the
gather is a collective, so a hook must call it alike on every rank).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from actbus.config import HooksConfig
from actbus.errors import ConfigError

log = logging.getLogger("actbus.hooks")

ENTRY_POINTS = "actbus.hooks"
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
MAX_HOOKS = 16
"""Hooks one request may carry."""
HOOK_KEYS = ("name", "layer", "point")
"""The keys of a hook selected by name."""


@dataclass
class HookCall:
    """What a hook is called with: one request's rows at one point in one step."""

    request_id: str
    layer: int
    point: str
    positions: torch.Tensor
    """int64 ``[n]``: the rows' token positions."""
    rows: torch.Tensor
    """``[n, hidden]``: the stream there (a copy: changing it changes nothing)."""
    saved: dict[str, Any]
    """This request's results (the same dict on every call), back on ``Hook.saved``."""
    model: nn.Module
    gather: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def param(self, name: str) -> torch.Tensor:
        """The engine's parameter ``name`` (as ``model.named_parameters`` spells it),
        gathered across tensor-parallel ranks along its sharded dimension."""
        p = self.model.get_parameter(name)
        dim = getattr(p, "output_dim", None)
        dim = getattr(p, "input_dim", None) if dim is None else dim
        if self.gather is None or dim is None:
            return p.detach()
        return self.gather(p.detach(), int(dim))


@dataclass(eq=False)
class Hook:
    """A callable at ``layer`` and ``point``: ``fn(call: HookCall)`` returns new rows
    (``[n, hidden]``, replacing the stream there) or None (read only)."""

    fn: Callable[[HookCall], torch.Tensor | None]
    layer: int
    point: str = "post_block"
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Caller's request id -> what the hook saved for it."""


_OBJECTS: dict[str, tuple[Hook, str]] = {}
"""In-process hooks of requests in flight: token -> (hook, caller's request id)."""


def take_hooks(
    raw: Any, cfg: HooksConfig | None, *, over_http: bool, in_process: bool
) -> tuple[Any, list | None]:
    """``raw`` without its ``user_hooks`` key, and the request's hooks as the worker
    reads them (``[kind, token or name, layer, point]``); None: no hooks. The key is
    the config's name for them: ``hooks`` is the capture selection's hook points.
    ``in_process``: the engine's one worker runs in this process, so a ``Hook``
    object can run there."""
    if not (isinstance(raw, dict) and "user_hooks" in raw):
        return raw, None
    raw = dict(raw)
    hooks = raw.pop("user_hooks")
    where = "extra_args.actbus.user_hooks"
    if cfg is None:
        raise ConfigError(f"{where}: this engine runs no hooks; add an actbus.user_hooks entry")
    if not isinstance(hooks, (list, tuple)) or not 1 <= len(hooks) <= MAX_HOOKS:
        raise ConfigError(f"{where}: expected a list of 1..{MAX_HOOKS} hooks")
    out = []
    for i, h in enumerate(hooks):
        w = f"{where}[{i}]"
        if isinstance(h, Hook):
            if over_http or not in_process:
                raise ConfigError(
                    f"{w}: a Hook object runs only in the caller's process (an offline LLM "
                    f"started with {IN_PROCESS_ENV}=0, one worker); otherwise select an "
                    "installed hook by name"
                )
            layer, point, item = h.layer, h.point, ["obj", None]
        elif isinstance(h, dict):
            extra = sorted(str(k) for k in h if k not in HOOK_KEYS)
            if extra:
                raise ConfigError(
                    f"{w}.{extra[0]:.40}: unknown key; a hook names "
                    f"{', '.join(HOOK_KEYS)} (and nothing else)"
                )
            name = h.get("name")
            if name not in cfg.named:
                raise ConfigError(
                    f"{w}.name: {name!r:.60} is not a hook this engine lets requests select "
                    f"(actbus.user_hooks.named: {list(cfg.named)})"
                )
            layer, point, item = h.get("layer"), h.get("point", "post_block"), ["name", name]
        else:
            raise ConfigError(f"{w}: expected an actbus.hooks.Hook or {{'name': NAME, 'layer': L}}")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer not in cfg.layers:
            raise ConfigError(f"{w}.layer: expected one of the hookable layers {list(cfg.layers)}")
        if point not in cfg.points:
            raise ConfigError(f"{w}.point: expected one of the hookable points {list(cfg.points)}")
        out.append([*item, layer, point, h])
    return (raw or None), out


def resolve_named(names: tuple[str, ...], where: str = "actbus.user_hooks.named") -> dict:
    """Each named hook's callable, loaded from the installed entry points of group
    ``actbus.hooks`` in one scan, at start: a name not installed fails the start
    (the engine step never searches for one)."""
    if not names:
        return {}
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    for e in entry_points(group=ENTRY_POINTS):
        found.setdefault(e.name, e)
    missing = [n for n in names if n not in found]
    if missing:
        have = sorted(found)[:20] or "none"
        raise ConfigError(
            f"{where}: {missing} not installed as entry points of group {ENTRY_POINTS!r} "
            f"(installed: {have}); install the package that provides them or drop the names"
        )
    out = {}
    for n in names:
        try:
            fn = found[n].load()
        except Exception as e:
            raise ConfigError(f"{where}: hook {n!r} does not load ({type(e).__name__}: {e})") from e
        if not callable(fn):
            raise ConfigError(f"{where}: hook {n!r} ({found[n].value}) is not callable")
        out[n] = fn
    return out


def to_wire(hooks: list, caller_id: str) -> list:
    """Register the in-process ones under fresh tokens; what the worker gets."""
    wire = []
    for kind, name, layer, point, h in hooks:
        if kind == "obj":
            name = secrets.token_hex(16)
            _OBJECTS[name] = (h, caller_id)
        wire.append([kind, name, layer, point])
    return wire


def cache_salt() -> str:
    """A hook may read or change any prompt row: a request with one shares no cache."""
    return "actbus-hooks:" + secrets.token_hex(16)


@torch.library.custom_op("actbus::user_hook", mutates_args=("target",))
def user_hook(target: torch.Tensor, other: torch.Tensor | None, layer: int, point: str) -> None:
    """Runs the step's hooks at ``(layer, point)``: the stream is ``target + other``
    (``target`` alone when ``other`` is None); new rows go into ``target``."""
    runner = HookRunner.current
    if runner is not None:
        runner.run(target, other, layer, point)


@user_hook.register_fake
def _user_hook_fake(target, other, layer, point) -> None:
    return None


def install_hooks(decoder: nn.ModuleList, layers: tuple[int, ...], points: tuple[str, ...]) -> None:
    """Mark the layers whose forward (``actbus.engine.layers.wrap_layer``) calls the op."""
    for i in layers:
        decoder[i]._actbus_user_hooks = (i, tuple(points))


@dataclass
class _Req:
    caller_id: str
    hooks: list[tuple[Callable, int, str, dict]]  # fn, layer, point, saved
    tokens: list[str]


class HookRunner:
    """The worker side: each request's hooks, and the step's layout (before each
    forward, ``fill``; cleared after it, ``done``)."""

    current: HookRunner | None = None

    def __init__(self, model: nn.Module, gather=None, named: dict | None = None) -> None:
        """``named``: the engine's named hooks, resolved at start (``resolve_named``)."""
        self.model = model
        self.gather = gather
        self._reqs: dict[str, _Req] = {}
        self._named: dict[str, Callable] = dict(named or {})
        self.unknown = 0
        """Hooks left out because their name was not resolved at start (the front end
        refuses such names, so none; counted in case)."""
        self._layout: list[tuple[_Req, int, int, int]] = []  # req, lo, hi, first position
        HookRunner.current = self

    def admit(self, new: list, finished: set[str]) -> None:
        for rid in finished:
            st = self._reqs.pop(rid, None)
            for t in st.tokens if st else ():
                _OBJECTS.pop(t, None)
        for rid, _plen, wire in new:
            hooks = (wire or {}).get("user_hooks")
            if not hooks or rid in self._reqs:
                continue
            got, tokens, caller = [], [], rid
            for kind, name, layer, point in hooks:
                if kind == "obj":
                    hit = _OBJECTS.get(name)
                    if hit is None:
                        log.error("actbus: request %s: its hook is not in this process", rid)
                        continue
                    h, caller = hit
                    tokens.append(name)
                    got.append((h.fn, int(layer), str(point), h.saved.setdefault(caller, {})))
                else:
                    fn = self._named.get(str(name))
                    if fn is None:
                        self.unknown += 1
                        log.error(
                            "actbus: request %s: hook %s was not resolved at start", rid, name
                        )
                        continue
                    got.append((fn, int(layer), str(point), {}))
            self._reqs[rid] = _Req(caller, got, tokens)

    def fill(self, req_ids: list[str], offsets, starts: dict[str, int]) -> None:
        self._layout = [
            (self._reqs[rid], int(offsets[i]), int(offsets[i + 1]), int(starts.get(rid, 0)))
            for i, rid in enumerate(req_ids)
            if rid in self._reqs and offsets[i + 1] > offsets[i]
        ]

    def done(self) -> None:
        self._layout = []

    def run(self, target: torch.Tensor, other, layer: int, point: str) -> None:
        for st, lo, hi, first in self._layout:
            for fn, h_layer, h_point, saved in st.hooks:
                if h_layer != layer or h_point != point or hi > target.shape[0]:
                    continue
                stream = target[lo:hi] if other is None else target[lo:hi] + other[lo:hi]
                call = HookCall(
                    st.caller_id,
                    layer,
                    point,
                    torch.arange(first, first + hi - lo, device=target.device),
                    stream.clone(),
                    saved,
                    self.model,
                    self.gather,
                )
                try:
                    new = fn(call)
                except Exception:  # a hook's bug fails its rows, not the engine
                    log.exception("actbus: hook at layer %d %s raised", layer, point)
                    continue
                if new is None:
                    continue
                if tuple(new.shape) != tuple(stream.shape) or not torch.isfinite(new).all():
                    log.error(
                        "actbus: hook at layer %d %s returned bad rows; ignored", layer, point
                    )
                    continue
                target[lo:hi] += new.to(target.dtype) - stream
