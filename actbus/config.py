"""Capture configuration: the ``actbus`` entry of vLLM's ``additional_config``.

It lives in ``additional_config`` (not environment variables) because it changes
the traced graph, and vLLM hashes ``additional_config`` into its compile-cache
key, so a cached graph without taps is never reused for a run with taps.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from actbus.bus.addresses import check_address
from actbus.bus.control import ControlConfig
from actbus.bus.endpoints import RANK_EXAMPLE, for_rank, has_rank
from actbus.bus.security import check_server_keys
from actbus.errors import ConfigError
from actbus.monitor.config import MonitorConfig
from actbus.steer.config import SteerConfig
from actbus.streams import parse_hooks, parse_layers, parse_positions
from actbus.wire import MAX_REQUEST_ID_CHARS, WireError, check_tags

REQUESTS = ("all", "selected")
DEFAULT_ADDRESS = "ipc:///tmp/actbus.sock"
MAX_TAGS_BYTES = 4096


@dataclass(frozen=True)
class DataParallel:
    """A front end's data-parallel layout."""

    size: int
    local: tuple[int, ...]
    """Ranks whose engine cores (and publishers) run on this node."""
    served: tuple[int, ...]
    """Ranks this front end sends requests to."""

    @property
    def remote(self) -> tuple[int, ...]:
        """Ranks this front end serves whose publishers are on other nodes."""
        return tuple(r for r in self.served if r not in self.local)


HOOK_POINTS = ("pre_attn", "post_block")
"""Where user hooks can run (``actbus.user_hooks``)."""


@dataclass(frozen=True)
class HooksConfig:
    """The engine's ``actbus.user_hooks``: where hooks may run, and the named ones HTTP
    callers may select."""

    layers: tuple[int, ...]
    points: tuple[str, ...] = ("post_block",)
    named: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: Any, where: str = "actbus.user_hooks") -> HooksConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{'layers': [3]}}")
        for k in raw:
            if k not in ("layers", "points", "named"):
                raise ConfigError(f"{where}.{k}: unknown key; valid keys are layers, points, named")
        if "layers" not in raw:
            raise ConfigError(f"{where}.layers: required (the layers hooks may run at)")
        layers = parse_layers(raw["layers"], f"{where}.layers")
        points = raw.get("points", ["post_block"])
        points = [points] if isinstance(points, str) else points
        if not isinstance(points, list) or not points:
            raise ConfigError(f"{where}.points: expected a list of {', '.join(HOOK_POINTS)}")
        for i, p in enumerate(points):
            if p not in HOOK_POINTS:
                raise ConfigError(
                    f"{where}.points[{i}]: {p!r:.40} is not a point user hooks run at (they "
                    f"run at {' and '.join(HOOK_POINTS)}; post_attn and mlp_out are read "
                    "by capture and changed by steering's operations, actbus.steer.ops)"
                )
        named = raw.get("named", [])
        if not isinstance(named, list) or not all(isinstance(n, str) and n for n in named):
            raise ConfigError(f"{where}.named: expected a list of entry-point names")
        return cls(tuple(layers), tuple(dict.fromkeys(points)), tuple(named))


@dataclass(frozen=True, eq=False)
class CaptureConfig:
    """What to capture and where to publish it."""

    publish: str = DEFAULT_ADDRESS
    """ZeroMQ address the publisher binds: ``ipc:///path`` or ``tcp://127.0.0.1:PORT``.
    Under data parallelism a template: ``{dp_rank}`` or ``{BASE+dp_rank}`` is the rank
    of the engine that binds it (``publish_address``)."""
    layers: tuple[int, ...] = ()
    """0-based decoder layer indices; ``"all"`` in the input means every layer."""
    hooks: tuple[str, ...] = ("post_block",)
    """Hook points per layer (see ``actbus.streams.HOOKS``); ``post_block`` is the stream
    leaving it."""
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
    max_window_mb: float = 256.0
    """Credit one subscriber may ask for, in MiB: what it may hold in flight, unread.
    A HELLO asking more (``--window-mb``) is refused, naming this key."""
    max_subscribers: int = 256
    """Subscribers at once; one more is refused, naming this key."""
    http_return_max_request_mb: float = 256.0
    """Rows one HTTP call (all its prompts and samples) may ask back with ``"return"``,
    in MiB, counted from its prompts, ``max_tokens`` and selection before they are
    queued; a call asking more is refused (HTTP 400) naming this key
    (``actbus.capture.http``)."""
    http_return_max_server_mb: float = 2048.0
    """Rows the server holds for HTTP callers at once, in MiB: those reserved by calls
    in flight (until their responses are sent) plus those waiting to be fetched; a
    request beyond it is refused, naming this key."""
    http_return_fetch_client_mb: float = 512.0
    """Rows one client (its address) may have kept, or on their way, for fetching at
    once, in MiB; a ``"fetch"`` request beyond it is refused, naming this key."""
    http_return_fetch_ttl_s: float = 300.0
    """How long rows kept for ``GET /v1/actbus/returns/ID`` wait to be fetched (once)."""
    http_return_chunk_wait_s: float = 0.25
    """How long a streamed chunk waits, at most, for the rows of the tokens it carries
    before it goes without them (they follow in a later chunk, counted); 0: never."""
    shm_mb: float = 1024.0
    """The shared-memory region subscribers on this host read rows from, in MiB
    (``actbus.bus.shm``; made when the first subscribes, backed as it fills). 0: they
    read from the socket, as remote ones do."""
    steer: SteerConfig | None = None
    """Steering (``actbus.steer.config``): which points can be steered, named vectors
    and global steering; None: the graph has no steering at all."""
    monitor: MonitorConfig | None = None
    """Monitors (``actbus.monitor.config``): named probes and SAE features scored in the
    compiled graph, their scores published on the bus; None: no monitor in the graph."""
    user_hooks: HooksConfig | None = None
    """User hooks (``actbus.hooks``): the layers and points where a request's Python
    hooks may run, and the installed ones HTTP callers may select; None: none."""
    control: ControlConfig | None = None
    """Live weight pushes (``actbus.bus.control``): the engine core's authenticated
    endpoint that swaps monitors' weights and live steering vectors between steps;
    None: no endpoint."""
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
            check_server_keys(**keys)
            kw.update({k: os.path.abspath(v) for k, v in keys.items()})
        publish = raw.get("publish", DEFAULT_ADDRESS)
        check_address(  # rank 0's address stands for the others (check_data_parallel)
            for_rank(publish, 0) if isinstance(publish, str) else publish,
            field_name="actbus.publish",
            curve=bool(keys),
            insecure_allow_any_interface=insecure,
        )
        kw["publish"] = publish
        if "layers" not in raw:
            raise ConfigError("actbus.layers: required; give a list such as [1, 3] or 'all'")
        layers = raw["layers"]
        if layers == "all":
            kw["all_layers"] = True
        else:
            kw["layers"] = parse_layers(layers, "actbus.layers")
        if "hooks" in raw:
            kw["hooks"] = parse_hooks(raw["hooks"], "actbus.hooks")
        for name, kind, lo, what in (
            ("queue_mb", int, 1, "an integer number of MiB >= 1"),
            ("heartbeat_s", (int, float), 0.01, "seconds >= 0.01"),
            ("subscriber_timeout_s", (int, float), 1.0, "seconds >= 1"),
            ("max_window_mb", (int, float), 1.0, "MiB >= 1 (credit per subscriber)"),
            ("max_subscribers", int, 1, "an integer >= 1"),
            ("http_return_max_request_mb", (int, float), 0.001, "MiB >= 0.001"),
            ("http_return_max_server_mb", (int, float), 0.001, "MiB >= 0.001"),
            ("http_return_fetch_client_mb", (int, float), 0.001, "MiB >= 0.001"),
            ("http_return_fetch_ttl_s", (int, float), 1.0, "seconds >= 1"),
            ("http_return_chunk_wait_s", (int, float), 0.0, "seconds >= 0"),
            ("shm_mb", (int, float), 0, "MiB >= 0 (0: no shared memory)"),
        ):
            if name in raw:
                v = raw[name]
                if not isinstance(v, kind) or isinstance(v, bool) or not lo <= v < math.inf:
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
        if "positions" in raw:
            kw["positions"] = parse_positions(raw["positions"], "actbus.positions")
        if "tags" in raw:
            kw["tags"] = check_request_tags(raw["tags"], "actbus.tags")
        if "model_name" in raw:
            if not isinstance(raw["model_name"], str):
                raise ConfigError("actbus.model_name: expected a string")
            kw["model_name"] = raw["model_name"]
        if "steer" in raw:
            kw["steer"] = SteerConfig.from_dict(raw["steer"])
        if "monitor" in raw:
            kw["monitor"] = MonitorConfig.from_dict(raw["monitor"])
        if "user_hooks" in raw:
            kw["user_hooks"] = HooksConfig.from_dict(raw["user_hooks"])
        if "control" in raw:
            if "monitor" not in kw and not (kw.get("steer") and kw["steer"].live):
                raise ConfigError(
                    "actbus.control: pushes change monitors' weights or live steering "
                    "vectors, and this engine has neither; add an actbus.monitor entry or "
                    "actbus.steer.live names, or remove actbus.control"
                )
            kw["control"] = ControlConfig.from_raw(raw["control"], kw)
        return cls(**kw)

    def publish_address(self, dp_rank: int = 0) -> str:
        """The address the publisher of data-parallel rank ``dp_rank`` binds."""
        return for_rank(self.publish, dp_rank)

    def check_data_parallel(self, size: int) -> list[str]:
        """The addresses of ranks ``0 .. size-1``, each checked as a bind address;
        refuses (naming ``actbus.publish``) a template on which two ranks would bind
        one address: their streams would be one socket's, whoever bound it last."""
        if size > 1 and not has_rank(self.publish):
            raise ConfigError(
                f"actbus.publish={self.publish!r}: data_parallel_size={size}, and every rank "
                f"would bind this one address; put the rank in it, e.g. {RANK_EXAMPLE}, and "
                "subscribe to all of them (--connect with a range, docs/deployment.md)"
            )
        seen: dict[str, int] = {}
        out = []
        for rank in range(size):
            addr = check_address(
                self.publish_address(rank),
                field_name=f"actbus.publish (data-parallel rank {rank})",
                curve=self.server_secret_key is not None,
                insecure_allow_any_interface=self.insecure_allow_any_interface,
            )
            key = _bind_key(addr)
            if key in seen:
                raise ConfigError(
                    f"actbus.publish={self.publish!r}: data-parallel ranks {seen[key]} and "
                    f"{rank} would both bind {addr}; make the rank part of the address itself, "
                    f"e.g. {RANK_EXAMPLE}"
                )
            seen[key] = rank
            out.append(addr)
        return out

    def resolve_layers(self, num_layers: int, model: str) -> tuple[int, ...]:
        """The layer indices for a model with ``num_layers`` decoder layers."""
        if self.all_layers:
            return tuple(range(num_layers))
        return parse_layers(self.layers, "actbus.layers", num_layers=num_layers, model=model)


def _bind_key(addr: str) -> str:
    """What two binds share when they clash: an ipc file by its normalized path."""
    if addr.startswith("ipc://") and not addr.startswith("ipc://@"):
        return "ipc://" + os.path.normpath(os.path.abspath(addr[len("ipc://") :]))
    return addr


def check_request_tags(raw: Any, where: str) -> dict[str, Any]:
    """Labels put on a request (its rows carry them): string keys, values msgpack can
    carry, at most ``MAX_TAGS_BYTES`` encoded. Returns a copy."""
    import msgpack

    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(f"{where}: expected a mapping of string keys to values, got {raw!r}")
    try:
        packed = msgpack.packb(raw, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{where}: values must be strings, numbers, lists or maps ({e})") from e
    if len(packed) > MAX_TAGS_BYTES:
        raise ConfigError(
            f"{where}: {len(packed)} bytes encoded; keep tags under {MAX_TAGS_BYTES} bytes"
        )
    try:  # as subscribers will read them: one request's bad tags must not cost its step
        check_tags(msgpack.unpackb(packed, strict_map_key=False), where)
    except WireError as e:
        raise ConfigError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
    return dict(raw)


def check_request_id(request_id: str, where: str = "request_id", room: int = 0) -> str:
    """A request id that fits the wire's bound (subscribers refuse longer ones), with
    ``room`` characters to spare (vLLM's own id of a returned request adds its suffix)."""
    if len(request_id) + room > MAX_REQUEST_ID_CHARS:
        raise ConfigError(
            f"{where}: {len(request_id)} characters, more than the "
            f"{MAX_REQUEST_ID_CHARS - room} actbus carries; use a shorter request id"
        )
    return request_id
