"""Capture configuration: the ``actbus`` entry of vLLM's ``additional_config``.

It lives in ``additional_config`` (not environment variables) because it changes
the traced graph, and vLLM hashes ``additional_config`` into its compile-cache
key, so a cached graph without taps is never reused for a run with taps.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

HOOKS = ("pre_attn", "post_attn", "mlp_out", "post_block")
"""Per decoder layer: the residual stream entering it, after attention is added,
what the MLP block adds, and the stream leaving it (``post_attn + mlp_out``)."""
REQUESTS = ("all", "selected")
DEFAULT_ADDRESS = "ipc:///tmp/actbus.sock"
_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+|\*)$")


class ConfigError(ValueError):
    """Bad actbus configuration; the message names the field and the fix."""


@dataclass(frozen=True, eq=False)
class CaptureConfig:
    """What to capture and where to publish it."""

    publish: str = DEFAULT_ADDRESS
    """ZeroMQ address the publisher binds: ``ipc:///path`` or ``tcp://127.0.0.1:PORT``."""
    layers: tuple[int, ...] = ()
    """0-based decoder layer indices; ``"all"`` in the input means every layer."""
    hooks: tuple[str, ...] = ("post_block",)
    """Hook points per layer (see ``HOOKS``); ``post_block`` is the stream leaving it."""
    requests: str = "all"
    """``all``: every request is captured with this config's selection; ``selected``:
    only requests whose ``extra_args["actbus"]`` asks (the others cost only the
    in-graph copy). A request's own selection replaces the engine's either way."""
    positions: str | tuple[int, ...] = "all"
    """Default token positions: all, prompt, generated, last_prompt, last, or a list."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Tags put on every captured request (a request's own tags are merged over them)."""
    queue_mb: int = 1024
    """Byte budget of captured data waiting for the publisher thread. When full,
    the engine waits (lossless) rather than dropping."""
    heartbeat_s: float = 0.5
    """How often the publisher tells subscribers it is alive."""
    subscriber_timeout_s: float = 30.0
    """A subscriber silent this long is dropped and no longer waited for. A killed
    subscriber is noticed sooner, within a heartbeat, by its closed connection."""
    model_name: str | None = None
    """Name put in every message header; defaults to the served model name."""
    server_secret_key: str | None = None
    """CURVE: the publisher's secret certificate (``actbus keys DIR`` writes
    ``DIR/server.key_secret``). With ``authorized_keys``, every connection is encrypted
    and only listed subscribers get in; required to bind a non-loopback interface."""
    authorized_keys: str | None = None
    """CURVE: directory of the public certificates (``*.key``) of allowed subscribers."""
    insecure_allow_any_interface: bool = False
    """Bind a non-loopback interface without keys: anyone who reaches it reads the stream."""
    all_layers: bool = field(default=False, repr=False)

    @classmethod
    def from_dict(cls, raw: Any) -> CaptureConfig:
        """Parse and validate what needs no model; ``check_model`` does the rest."""
        if not isinstance(raw, dict):
            raise ConfigError(
                f"actbus: expected a mapping like {{'layers': [1, 3]}}, got {type(raw).__name__}"
            )
        known = {f.name for f in fields(cls) if f.name != "all_layers"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"actbus.{unknown[0]}: unknown key; valid keys are {', '.join(sorted(known))}"
            )
        kw: dict[str, Any] = {}
        insecure = raw.get("insecure_allow_any_interface", False)
        if not isinstance(insecure, bool):
            raise ConfigError(
                f"actbus.insecure_allow_any_interface: expected true or false, got {insecure!r}"
            )
        kw["insecure_allow_any_interface"] = insecure
        keys = {k: raw[k] for k in ("server_secret_key", "authorized_keys") if k in raw}
        if keys:
            from actbus.bus.security import check_server_keys

            check_server_keys(**keys)
            kw.update({k: os.path.abspath(v) for k, v in keys.items()})
        kw["publish"] = check_address(
            raw.get("publish", DEFAULT_ADDRESS),
            field_name="actbus.publish",
            curve=bool(keys),
            insecure_allow_any_interface=insecure,
        )
        if "layers" not in raw:
            raise ConfigError("actbus.layers: required; give a list such as [1, 3] or 'all'")
        layers = raw["layers"]
        if layers == "all":
            kw["all_layers"] = True
        else:
            if isinstance(layers, int) and not isinstance(layers, bool):
                layers = [layers]
            if not isinstance(layers, (list, tuple)) or not layers:
                raise ConfigError(
                    f"actbus.layers: expected a non-empty list of layer indices or 'all', "
                    f"got {layers!r}"
                )
            for i, v in enumerate(layers):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ConfigError(
                        f"actbus.layers[{i}]: expected a 0-based layer index (int >= 0), got {v!r}"
                    )
            kw["layers"] = tuple(sorted(set(layers)))
        if "hooks" in raw:
            hooks = raw["hooks"]
            if isinstance(hooks, str):
                hooks = [hooks]
            if not isinstance(hooks, (list, tuple)) or not hooks:
                raise ConfigError(f"actbus.hooks: expected a list of hook names, got {hooks!r}")
            for i, h in enumerate(hooks):
                if h not in HOOKS:
                    raise ConfigError(
                        f"actbus.hooks[{i}]: unknown hook {h!r}; supported: {', '.join(HOOKS)}"
                    )
            kw["hooks"] = tuple(dict.fromkeys(hooks))
        for name, kind, lo, what in (
            ("queue_mb", int, 1, "an integer number of MiB >= 1"),
            ("heartbeat_s", (int, float), 0.01, "seconds >= 0.01"),
            ("subscriber_timeout_s", (int, float), 1.0, "seconds >= 1"),
        ):
            if name in raw:
                v = raw[name]
                if not isinstance(v, kind) or isinstance(v, bool) or v < lo:
                    raise ConfigError(f"actbus.{name}: expected {what}, got {v!r}")
                kw[name] = v
        hb = kw.get("heartbeat_s", cls.heartbeat_s)
        if kw.get("subscriber_timeout_s", cls.subscriber_timeout_s) < 4 * hb:
            raise ConfigError(
                "actbus.subscriber_timeout_s: must be at least 4 x heartbeat_s, or live "
                "subscribers are dropped between heartbeats"
            )
        if "requests" in raw:
            if raw["requests"] not in REQUESTS:
                raise ConfigError(
                    f"actbus.requests: expected 'all' (capture every request) or 'selected' "
                    f"(only requests that set extra_args['actbus']), got {raw['requests']!r}"
                )
            kw["requests"] = raw["requests"]
        if "positions" in raw or "tags" in raw:
            from actbus.capture.selection import parse_positions, parse_tags

            if "positions" in raw:
                kw["positions"] = parse_positions(raw["positions"], "actbus.positions")
            if "tags" in raw:
                kw["tags"] = parse_tags(raw["tags"], "actbus.tags")
        if "model_name" in raw:
            if not isinstance(raw["model_name"], str):
                raise ConfigError("actbus.model_name: expected a string")
            kw["model_name"] = raw["model_name"]
        return cls(**kw)

    def resolve_layers(self, num_layers: int, model: str) -> tuple[int, ...]:
        """The layer indices for a model with ``num_layers`` decoder layers."""
        if self.all_layers:
            return tuple(range(num_layers))
        for i, layer in enumerate(self.layers):
            if layer >= num_layers:
                raise ConfigError(
                    f"actbus.layers[{i}]: layer {layer} is out of range; model {model} has "
                    f"{num_layers} decoder layers (valid: 0..{num_layers - 1})"
                )
        return self.layers


def check_address(
    addr: Any,
    *,
    field_name: str,
    allow_remote: bool = False,
    curve: bool = False,
    insecure_allow_any_interface: bool = False,
) -> str:
    """Validate a ZeroMQ address.

    A bind address (``allow_remote=False``) on anything but ipc or loopback is
    refused unless CURVE keys secure it (``curve``) or the user said
    ``insecure_allow_any_interface``: activations are model internals, and a
    ``block`` subscriber can stall generation, so nobody should get either by accident.
    """
    if not isinstance(addr, str):
        raise ConfigError(f"{field_name}: expected a string address, got {addr!r}")
    if addr.startswith("ipc://"):
        path = addr[len("ipc://") :]
        if not path or path.startswith("@"):
            if path.startswith("@") and len(path) > 1:
                return addr  # Linux abstract namespace
            raise ConfigError(
                f"{field_name}={addr!r}: ipc address needs a path, e.g. ipc:///tmp/actbus.sock"
            )
        parent = os.path.dirname(os.path.abspath(path)) or "/"
        if not os.path.isdir(parent):
            raise ConfigError(f"{field_name}={addr!r}: directory {parent} does not exist")
        return addr
    m = _TCP.match(addr)
    if m:
        port = m.group("port")
        if port != "*" and not 0 < int(port) < 65536:
            raise ConfigError(f"{field_name}={addr!r}: port must be 1..65535")
        host = m.group("host").strip("[]")
        if not (allow_remote or curve or insecure_allow_any_interface or _is_loopback(host)):
            prefix = field_name.rpartition(".")[0] + "." if "." in field_name else ""
            raise ConfigError(
                f"{field_name}={addr!r}: binding a non-loopback interface is refused without "
                f"CURVE keys; run `actbus keys DIR` and set {prefix}server_secret_key="
                f"DIR/server.key_secret and {prefix}authorized_keys=DIR/authorized_keys, or set "
                f"{prefix}insecure_allow_any_interface=true (anyone who reaches it reads the "
                "stream); or bind ipc:// or tcp://127.0.0.1:PORT"
            )
        return addr
    raise ConfigError(
        f"{field_name}={addr!r}: not a ZeroMQ address; use ipc:///path/to/socket "
        "or tcp://127.0.0.1:PORT"
    )


def is_loopback_address(addr: str) -> bool:
    """True for ipc:// and tcp:// on a loopback host: reachable from this machine only."""
    if addr.startswith(("ipc://", "inproc://")):
        return True
    m = _TCP.match(addr)
    return bool(m) and _is_loopback(m.group("host").strip("[]"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
