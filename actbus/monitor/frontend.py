"""Front-end side of monitors: a request's ``monitor`` keys resolved into names.

``extra_args["actbus"]`` may carry ``"monitor"`` (a name or a list of names of the
engine's monitors), ``"monitor_global": false`` (no global monitors) and
``"monitor_return": true`` (the scores come back in the request's outputs:
``actbus.monitor.returns``). They are
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
KEYS = ("monitor", "monitor_global", "monitor_return")


def take_monitors(raw: Any, cfg: MonitorConfig | None) -> tuple[Any, tuple[str, ...], bool]:
    """``raw`` without its monitor keys (None if nothing else was in it), the
    request's monitor names (global ones first) and whether its scores come back."""
    own, use_global, returns = None, True, False
    if isinstance(raw, dict) and any(k in raw for k in KEYS):
        raw = dict(raw)
        own, use_global = raw.pop("monitor", None), raw.pop("monitor_global", True)
        returns = raw.pop("monitor_return", False)
        if cfg is None:
            raise ConfigError(
                f"{WHERE}: this engine has no monitors; add a 'monitor' entry to its actbus config"
            )
        if not raw:  # monitors alone: captured as a request without a selection
            raw = None
    if cfg is None:
        return raw, (), False
    names = cfg.request(own, use_global, WHERE)
    if not isinstance(returns, bool):
        raise ConfigError(
            f"{WHERE}_return: expected true or false (true: the scores come back in the "
            f"outputs), got {returns!r:.40}"
        )
    if returns and not names:
        raise ConfigError(
            f"{WHERE}_return: this request has no monitors to return; name some in "
            "'monitor' (the engine has no global ones, or monitor_global is false)"
        )
    return raw, names, returns
