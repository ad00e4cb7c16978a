"""Subscription handshake: what a subscriber asks for and how it is checked.

The publisher enforces each subscriber's policy; the names follow Vector's
``when_full`` (``block``, ``drop_newest``): ``block`` is lossless and makes the
publisher, and so the engine, wait for that subscriber. ``drop_oldest`` evicts the
oldest waiting message instead (fresh data for trainers); ``sample`` takes every
N-th step and drops the newest when full (dashboards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actbus.wire import SCHEMA_VERSION, WireError

POLICIES = ("block", "drop_newest", "drop_oldest", "sample")


def parse_policy(text: str) -> tuple[str, int]:
    """``"sample:10"`` or ``"sample:0.1"`` -> ``("sample", 10)``; others -> ``(name, 1)``."""
    name, _, arg = text.partition(":")
    if name not in POLICIES or (arg and name != "sample"):
        raise ValueError(
            f"unknown policy {text!r}; choose block, drop_newest, drop_oldest or sample:N"
        )
    if name != "sample":
        return name, 1
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"sample needs N (every N-th step) or a fraction, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"sample needs a positive N or fraction, got {text!r}")
    every = round(1 / value) if value < 1 else round(value)
    return name, max(1, every)


MAX_WINDOW = 1 << 20


@dataclass(frozen=True)
class Subscription:
    """A subscriber's request, sent in HELLO."""

    policy: str = "block"
    sample_every: int = 1
    """With ``policy="sample"``: take steps whose number is a multiple of this."""
    window: int = 64
    """Credit in messages: how many the publisher may send ahead of acknowledgements."""
    window_bytes: int = 128 << 20
    """Credit in bytes; whichever of the two runs out first holds sending back. A
    message larger than this still goes when nothing else is in flight."""
    layers: tuple[int, ...] | None = None
    hooks: tuple[str, ...] | None = None
    name: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "policy": self.policy,
            "sample_every": self.sample_every,
            "window": self.window,
            "window_bytes": self.window_bytes,
            "layers": list(self.layers) if self.layers is not None else None,
            "hooks": list(self.hooks) if self.hooks is not None else None,
            "name": self.name,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Subscription:
        schema = d.get("schema")
        if schema != SCHEMA_VERSION:
            raise WireError(
                f"subscriber speaks schema {schema!r}, publisher speaks {SCHEMA_VERSION}; "
                "install the same actbus version on both sides"
            )
        policy = d.get("policy", "block")
        if policy not in POLICIES:
            raise WireError(f"policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        every = d.get("sample_every", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise WireError(f"sample_every must be an int >= 1, got {every!r}")
        window = d.get("window", 64)
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= MAX_WINDOW:
            raise WireError(f"window must be an int in 1..{MAX_WINDOW}, got {window!r}")
        window_bytes = d.get("window_bytes", 128 << 20)
        if (
            not isinstance(window_bytes, int)
            or isinstance(window_bytes, bool)
            or not 1 <= window_bytes <= 1 << 40
        ):
            raise WireError(f"window_bytes must be an int in 1..2**40, got {window_bytes!r}")
        layers = d.get("layers")
        if layers is not None and (
            not isinstance(layers, list) or not all(isinstance(x, int) for x in layers)
        ):
            raise WireError(f"layers must be a list of ints or null, got {layers!r}")
        hooks = d.get("hooks")
        if hooks is not None and (
            not isinstance(hooks, list) or not all(isinstance(x, str) for x in hooks)
        ):
            raise WireError(f"hooks must be a list of strings or null, got {hooks!r}")
        name = d.get("name", "")
        return cls(
            policy=policy,
            sample_every=every,
            window=window,
            window_bytes=window_bytes,
            layers=tuple(layers) if layers is not None else None,
            hooks=tuple(hooks) if hooks is not None else None,
            name=str(name)[:200],
        )

    def wants(self, layer: int, hook: str) -> bool:
        return (self.layers is None or layer in self.layers) and (
            self.hooks is None or hook in self.hooks
        )
