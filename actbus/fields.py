"""Checks of the fields users write that every feature's config shares: which source
kind an entry names, names, and numbers that become float32 on the device.

Steering (``actbus.steer.config``) and monitors (``actbus.monitor.config``) both parse
them; they live here, below both, so each check and its message exists once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from actbus.errors import ConfigError
from actbus.streams import show_int

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Scales, thresholds, sharpness, weights and vector components become float32 on the
device: a float64 number past this (1e39, 1e300) would be inf there."""


def source_kind(raw: dict[str, Any], kinds: tuple[str, ...], where: str) -> str:
    """The one key of ``kinds`` that mapping ``raw`` names (a source is exactly one
    kind: ``{"sae": DIR, ...}``, ``{"probe": DIR}``, ``{"file": PATH}``, ...)."""
    found = [k for k in kinds if k in raw]
    if len(found) != 1:
        raise ConfigError(f"{where}: give exactly one of {', '.join(kinds)}")
    return found[0]


def check_name(name: Any, where: str) -> str:
    """A vector's or monitor's name: a non-empty string of at most 200 characters."""
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ConfigError(f"{where}: a vector name must be a non-empty string, got {name!r:.60}")
    return name


def check_finite(x: Any, where: str, what: str) -> float:
    """A number that is finite as float32, the type it becomes (an int too large for a
    float, or a float past ``FLOAT32_MAX``, is refused like NaN and Inf)."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool)
    try:
        ok = ok and math.isfinite(x) and abs(float(x)) <= FLOAT32_MAX
    except OverflowError:  # an int past float64
        ok = False
    if not ok:
        raise ConfigError(
            f"{where}: expected {what} (a number finite as float32: |x| <= {FLOAT32_MAX:.7g}), "
            f"got {show_int(x)}"
        )
    return float(x)
