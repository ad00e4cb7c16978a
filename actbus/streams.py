"""Which streams a decoder layer has, and the checks of a list of layers or hooks.

A stream is one (layer, hook) pair. The engine's config, a request's selection and a
subscriber's command line all name layers and hooks; they are checked here, once.
"""

from __future__ import annotations

import re
from typing import Any

from actbus.errors import ConfigError

POSITION_MODES = ("all", "prompt", "generated", "last_prompt", "last")
"""Which token positions of a request a selection or a steering entry names."""
HOOKS = ("pre_attn", "post_attn", "mlp_out", "post_block")
"""Per decoder layer: the residual stream entering it, after attention is added,
what the MLP block adds, and the stream leaving it (``post_attn + mlp_out``)."""
ROUTER_HOOK = "router"
"""Opt-in, mixture-of-experts layers only: per token the top-k expert ids and their
routing weights, as the layer's own router chose them (``actbus.router``)."""
CAPTURE_HOOKS = (*HOOKS, ROUTER_HOOK)
"""Every stream capture can publish: the four points of the stream and the router."""
STEER_HOOKS = ("pre_attn", "post_attn", "post_block")
"""Where a vector can be added: the stream entering a layer, after attention is added,
and leaving it (``mlp_out`` is not a point of the stream)."""
MAX_INT32 = (1 << 31) - 1
"""The wire's integers (positions, token ids, row offsets) are int32 (``actbus.wire``)."""


def parse_layers(
    raw: Any,
    where: str,
    *,
    num_layers: int | None = None,
    tapped: tuple[int, ...] | None = None,
    steerable: tuple[int, ...] | None = None,
    model: str | None = None,
    or_all: bool = True,
) -> tuple[int, ...]:
    """A non-empty list of 0-based layer indices (one int stands for itself), sorted,
    without repeats. With ``num_layers``, each must exist in the model (named by
    ``model``); with ``tapped``, each must be one the engine taps; with ``steerable``,
    one it can steer. ``"all"`` is the caller's to resolve (``or_all``: whether it
    does, so that the error offers it)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(
            f"{where}: expected a non-empty list of layer indices or 'all', got {raw!r}"
            if or_all
            else f"{where}: expected a layer index or a non-empty list of them, got {raw!r}"
        )
    owner = f"model {model}" if model else "the model"
    for i, v in enumerate(raw):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(
                f"{where}[{i}]: expected a 0-based layer index (int >= 0), got {show_int(v)}"
            )
        if num_layers is not None and v >= num_layers:
            raise ConfigError(
                f"{where}[{i}]: layer {show_int(v)} is out of range; {owner} has "
                f"{num_layers} decoder layers (valid: 0..{num_layers - 1})"
            )
        if tapped is not None and v not in tapped:
            raise ConfigError(
                f"{where}[{i}]: layer {v} is not tapped by this engine (it taps {list(tapped)}); "
                "add it to the engine's actbus.layers"
            )
        if steerable is not None and v not in steerable:
            raise ConfigError(
                f"{where}[{i}]: layer {v} cannot be steered on this engine (steerable: "
                f"{list(steerable)}); add it to the engine's actbus.steer.layers"
            )
    return tuple(sorted(set(raw)))


def parse_hooks(
    raw: Any,
    where: str,
    *,
    tapped: tuple[str, ...] | None = None,
    steerable: tuple[str, ...] | None = None,
) -> tuple[str, ...]:
    """A non-empty list of hook names (one name stands for itself), without repeats, in
    the order given, or with ``tapped`` in the engine's order, each one it taps. With
    ``steerable``, each must be a steering point (``STEER_HOOKS``) the engine steers."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(f"{where}: expected a hook name or a non-empty list of them, got {raw!r}")
    for i, h in enumerate(raw):
        if steerable is None and h not in CAPTURE_HOOKS:
            raise ConfigError(
                f"{where}[{i}]: unknown hook {h!r}; supported: {', '.join(CAPTURE_HOOKS)}"
            )
        if steerable is not None and h not in STEER_HOOKS:
            raise ConfigError(
                f"{where}[{i}]: {h!r} is not a steering point; use one of {', '.join(STEER_HOOKS)}"
            )
        if tapped is not None and h not in tapped:
            raise ConfigError(
                f"{where}[{i}]: hook {h!r} is not tapped by this engine (it taps "
                f"{list(tapped)}); add it to the engine's actbus.hooks"
            )
        if steerable is not None and h not in steerable:
            raise ConfigError(
                f"{where}[{i}]: hook {h!r} cannot be steered on this engine (steerable: "
                f"{list(steerable)}); add it to the engine's actbus.steer.hooks"
            )
    if tapped is not None:
        return tuple(h for h in tapped if h in raw)
    return tuple(dict.fromkeys(raw))


def parse_positions(raw: Any, where: str, *, max_len: int | None = None) -> str | tuple[int, ...]:
    """Token positions: a mode of ``POSITION_MODES`` or a non-empty list of 0-based
    positions (sorted, without repeats). Shared by the engine's config, a request's own
    selection (``actbus.capture.selection``) and steering entries (``actbus.steer``).

    A position must fit the wire's int32 (the worker does int64 arithmetic on them: a
    larger one would raise there and kill the engine), and with ``max_len`` (the
    model's ``max_model_len``, where the caller knows it) be one a request can have."""
    if isinstance(raw, str):
        if raw not in POSITION_MODES:
            raise ConfigError(
                f"{where}: unknown mode {raw!r}; use one of {', '.join(POSITION_MODES)} "
                "or a list of token positions"
            )
        return raw
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(
            f"{where}: expected one of {', '.join(POSITION_MODES)} or a non-empty list of "
            f"token positions, got {raw!r:.80}"
        )
    top = MAX_INT32 if max_len is None else min(MAX_INT32, max_len - 1)
    for i, p in enumerate(raw):
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ConfigError(f"{where}[{i}]: expected a 0-based token position, got {show_int(p)}")
        if p > top:
            bound = (
                f"the wire's int32 (at most {MAX_INT32})"
                if top == MAX_INT32
                else f"this engine's max_model_len {max_len}: a request's positions are 0..{top}"
            )
            raise ConfigError(f"{where}[{i}]: position {show_int(p)} is past {bound}")
    return tuple(sorted(set(raw)))


def show_int(v: Any) -> str:
    """A client's value for an error message, short (an int of thousands of digits
    cannot even be turned into text)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    return f"{v!r:.40}"


_POINT_KEY = re.compile(
    r"L(?P<new>\d{1,10})\.(?P<new_hook>[a-z_]+)"  # L3.post_block: the one spelling written
    r"|L?(?P<slash>\d{1,10})/(?P<slash_hook>[a-z_]+)"  # 3/post_block, L3/post_block (old stats)
    r"|layer-(?P<dir>\d{1,10})[/-](?P<dir_hook>[a-z_]+)"  # layer-03/post_block (old fs sink)
)


def point_key(layer: int, hook: str) -> str:
    """The one name of a (layer, hook) stream wherever a user sees it (mode line, stats,
    dashboards, fs-sink directories and manifest, trainer names): ``L3.post_block``.
    Filename-safe and one token."""
    return f"L{layer}.{hook}"


def parse_point_key(s: str) -> tuple[int, str]:
    """``(layer, hook)`` of a stream's name: ``L3.post_block``, or a spelling older runs,
    checkpoints and stats used (``3/post_block``, ``L3/post_block``,
    ``layer-03/post_block``, ``layer-03-post_block``), so they keep loading."""
    m = _POINT_KEY.fullmatch(s) if isinstance(s, str) else None
    if m is None:
        raise ConfigError(
            f"stream name {s!r:.80} is not a (layer, hook) name; write it as "
            f"L<layer>.<hook>, e.g. L3.post_block (hooks: {', '.join(CAPTURE_HOOKS)})"
        )
    digits = m["new"] or m["slash"] or m["dir"]
    hook = m["new_hook"] or m["slash_hook"] or m["dir_hook"]
    layer = int(digits)
    if hook not in CAPTURE_HOOKS:
        raise ConfigError(
            f"stream name {s!r:.80}: unknown hook {hook!r}; supported: {', '.join(CAPTURE_HOOKS)}"
        )
    if layer > MAX_INT32:
        raise ConfigError(f"stream name {s!r:.80}: layer {show_int(layer)} is past int32")
    return layer, hook
