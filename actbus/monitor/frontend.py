"""Front-end side of monitors: a request's ``monitor`` keys resolved into names.

``extra_args["actbus"]`` may carry ``"monitor"`` (a name or a list of names of the
engine's monitors) and ``"monitor_global": false`` (no global monitors). They are
taken out of the entry here, before the capture selection is parsed, checked against
the engine's config (a bad one fails that request alone, naming the field), and the
names travel to the worker with the request. Monitors only read the stream, so they
never change a request's cache salt.
"""

from __future__ import annotations

from typing import Any

from actbus.errors import ConfigError
from actbus.monitor.config import MonitorConfig

WHERE = "extra_args.actbus.monitor"
KEYS = ("monitor", "monitor_global")


def take_monitors(raw: Any, cfg: MonitorConfig | None) -> tuple[Any, tuple[str, ...]]:
    """``raw`` without its monitor keys (None if nothing else was in it), and the
    request's monitor names (global ones first)."""
    own, use_global = None, True
    if isinstance(raw, dict) and any(k in raw for k in KEYS):
        raw = dict(raw)
        own, use_global = raw.pop("monitor", None), raw.pop("monitor_global", True)
        if cfg is None:
            raise ConfigError(
                f"{WHERE}: this engine has no monitors; add a 'monitor' entry to its actbus config"
            )
        if not raw:  # monitors alone: captured as a request without a selection
            raw = None
    if cfg is None:
        return raw, ()
    return raw, cfg.request(own, use_global, WHERE)
