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

from actbus.config import check_request_tags
from actbus.errors import ConfigError
from actbus.streams import parse_hooks, parse_layers, parse_positions


@dataclass(frozen=True)
class Selection:
    """Normalized: layers and hooks are subsets of what the engine taps."""

    layers: tuple[int, ...]
    hooks: tuple[str, ...]
    positions: str | tuple[int, ...] = "all"
    """A mode of ``actbus.streams.POSITION_MODES`` or explicit 0-based token positions."""
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


REQUEST_KEYS = (
    "layers, hooks, positions, tags, return (capture); steer, steer_global (steering); "
    "monitor, monitor_global, monitor_return (monitors)"
)
"""Every key a request's ``actbus`` entry may have: the steering and monitor keys are
taken out before the selection is parsed, so its unknown-key error names them too."""


def parse_selection(
    raw: Any,
    *,
    engine_layers: tuple[int, ...],
    engine_hooks: tuple[str, ...],
    num_layers: int,
    base: Selection | None = None,
    where: str = "extra_args.actbus",
    max_len: int | None = None,
) -> Selection:
    """Check a user's selection against what the engine taps (and its positions
    against the model's ``max_len``, when given).

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
            raise ConfigError(f"{where}.{key}: unknown key; valid keys are {REQUEST_KEYS}")
    layers = base.layers
    if raw.get("layers") == "all":
        layers = engine_layers
    elif "layers" in raw:
        layers = parse_layers(
            raw["layers"], f"{where}.layers", num_layers=num_layers, tapped=engine_layers
        )
    hooks = base.hooks
    if raw.get("hooks") == "all":
        hooks = engine_hooks
    elif "hooks" in raw:
        hooks = parse_hooks(raw["hooks"], f"{where}.hooks", tapped=engine_hooks)
    positions = base.positions
    if "positions" in raw:
        positions = parse_positions(raw["positions"], f"{where}.positions", max_len=max_len)
    tags = dict(base.tags)
    if "tags" in raw:
        tags.update(check_request_tags(raw["tags"], f"{where}.tags"))
    returns = raw.get("return", base.returns)
    if not isinstance(returns, bool):
        raise ConfigError(
            f"{where}.return: expected true or false, got {returns!r:.50} (true attaches the "
            "request's activations to its outputs)"
        )
    return Selection(layers, hooks, positions, tags, returns)
