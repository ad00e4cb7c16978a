"""What to capture of one request: layers, hooks, positions and tags.

A selection comes from the engine config (every request, ``requests: all``) or
from the request itself (``SamplingParams.extra_args["actbus"]``, or
``vllm_xargs`` over HTTP), which replaces the engine's for that request. It is
parsed and checked once, in the front end, where a bad one fails that request
alone; the worker receives the normalized form and trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actbus.config import HOOKS, ConfigError

POSITION_MODES = ("all", "prompt", "generated", "last_prompt", "last")
MAX_TAGS_BYTES = 4096


@dataclass(frozen=True)
class Selection:
    """Normalized: layers and hooks are subsets of what the engine taps."""

    layers: tuple[int, ...]
    hooks: tuple[str, ...]
    positions: str | tuple[int, ...] = "all"
    """A mode of ``POSITION_MODES`` or explicit 0-based token positions."""
    tags: dict[str, Any] = field(default_factory=dict)
    returns: bool = False
    """Attach the rows to the request's own outputs too (``"return": true``)."""

    @property
    def keys(self) -> tuple[tuple[int, str], ...]:
        return tuple((layer, hook) for layer in self.layers for hook in self.hooks)

    def bypasses_prefix_cache(self, prompt_len: int) -> bool:
        """Whether prompt positions the prefix cache would skip are wanted.

        vLLM always computes the last prompt token, so only earlier ones matter.
        """
        if self.positions in ("all", "prompt"):
            return True
        if isinstance(self.positions, tuple):
            return any(p < prompt_len - 1 for p in self.positions)
        return False

    def row_mask(self, positions: np.ndarray, prompt_len: int) -> np.ndarray | None:
        """Which of ``positions`` to publish now; None means all of them.

        ``last`` publishes nothing here: its row is held until the request ends.
        """
        p = self.positions
        if p == "all":
            return None
        if p == "prompt":
            return positions < prompt_len
        if p == "generated":
            return positions >= prompt_len
        if p == "last_prompt":
            return positions == prompt_len - 1
        if p == "last":
            return np.zeros(len(positions), dtype=bool)
        return np.isin(positions, np.asarray(p, dtype=np.int64))

    def to_wire(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "hooks": list(self.hooks),
            "positions": self.positions
            if isinstance(self.positions, str)
            else list(self.positions),
            "tags": self.tags,
            "return": self.returns,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Selection:
        """The normalized form written by ``parse_selection``; not re-validated."""
        pos = d["positions"]
        return cls(
            layers=tuple(d["layers"]),
            hooks=tuple(d["hooks"]),
            positions=pos if isinstance(pos, str) else tuple(pos),
            tags=dict(d.get("tags") or {}),
            returns=bool(d.get("return", False)),
        )


def parse_selection(
    raw: Any,
    *,
    engine_layers: tuple[int, ...],
    engine_hooks: tuple[str, ...],
    num_layers: int,
    base: Selection | None = None,
    where: str = "extra_args.actbus",
) -> Selection:
    """Check a user's selection against what the engine taps.

    Missing fields default to the engine's (``base``): ``{"tags": {...}}`` alone
    captures what the engine captures, with labels. ``True`` means the defaults.
    """
    base = base or Selection(engine_layers, engine_hooks)
    if raw is True:
        return base
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: expected a mapping such as {{'layers': [3], 'positions': 'last_prompt'}} "
            f"or true, got {type(raw).__name__}"
        )
    known = ("layers", "hooks", "positions", "tags", "return")
    for key in raw:
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key; valid keys are {', '.join(known)}")
    layers = base.layers
    if "layers" in raw:
        layers = _layers(raw["layers"], engine_layers, num_layers, f"{where}.layers")
    hooks = base.hooks
    if "hooks" in raw:
        hooks = _hooks(raw["hooks"], engine_hooks, f"{where}.hooks")
    positions = base.positions
    if "positions" in raw:
        positions = parse_positions(raw["positions"], f"{where}.positions")
    tags = dict(base.tags)
    if "tags" in raw:
        tags.update(parse_tags(raw["tags"], f"{where}.tags"))
    returns = raw.get("return", base.returns)
    if not isinstance(returns, bool):
        raise ConfigError(
            f"{where}.return: expected true or false, got {returns!r:.50} (true attaches the "
            "request's activations to its outputs)"
        )
    return Selection(layers, hooks, positions, tags, returns)


def parse_positions(raw: Any, where: str) -> str | tuple[int, ...]:
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
            f"token positions, got {raw!r}"
        )
    for i, p in enumerate(raw):
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ConfigError(f"{where}[{i}]: expected a 0-based token position, got {p!r}")
    return tuple(sorted(set(raw)))


def parse_tags(raw: Any, where: str) -> dict[str, Any]:
    import msgpack

    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(f"{where}: expected a mapping of string keys to values, got {raw!r}")
    try:
        size = len(msgpack.packb(raw, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{where}: values must be strings, numbers, lists or maps ({e})") from e
    if size > MAX_TAGS_BYTES:
        raise ConfigError(f"{where}: {size} bytes encoded; keep tags under {MAX_TAGS_BYTES} bytes")
    return dict(raw)


def _layers(raw: Any, engine: tuple[int, ...], num_layers: int, where: str) -> tuple[int, ...]:
    if raw == "all":
        return engine
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(
            f"{where}: expected a non-empty list of layer indices or 'all', got {raw!r}"
        )
    for i, v in enumerate(raw):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{where}[{i}]: expected a 0-based layer index (int), got {v!r}")
        if not 0 <= v < num_layers:
            raise ConfigError(
                f"{where}[{i}]: layer {v} is out of range; the model has {num_layers} decoder "
                f"layers (valid: 0..{num_layers - 1})"
            )
        if v not in engine:
            raise ConfigError(
                f"{where}[{i}]: layer {v} is not tapped by this engine (it taps {list(engine)}); "
                "add it to the engine's actbus.layers"
            )
    return tuple(sorted(set(raw)))


def _hooks(raw: Any, engine: tuple[str, ...], where: str) -> tuple[str, ...]:
    if raw == "all":
        return engine
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(f"{where}: expected a non-empty list of hook names, got {raw!r}")
    for i, h in enumerate(raw):
        if h not in HOOKS:
            raise ConfigError(f"{where}[{i}]: unknown hook {h!r}; hooks are {', '.join(HOOKS)}")
        if h not in engine:
            raise ConfigError(
                f"{where}[{i}]: hook {h!r} is not tapped by this engine (it taps "
                f"{list(engine)}); add it to the engine's actbus.hooks"
            )
    return tuple(h for h in engine if h in raw)
