"""What every subscribing command takes, written once: ``actbus run``, ``actbus
dashboard``, ``actbus stats`` and the trainers share these flags, their help, their
checks and their errors, and build their ``Subscription`` and CURVE keys from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from actbus.bus.endpoints import Endpoints
from actbus.bus.protocol import MAX_NAME, MAX_WINDOW, Subscription, parse_match, parse_policy
from actbus.bus.security import ClientAuth
from actbus.errors import ConfigError
from actbus.flags import add_fields, flag, name_flag
from actbus.streams import parse_hooks, parse_layers

if TYPE_CHECKING:
    from actbus.bus.fanin import FanIn
    from actbus.bus.subscriber import Subscriber

log = logging.getLogger("actbus.options")
MAX_WINDOW_MB = float(1 << 20)  # the publisher accepts up to 1 TiB of credit
_ADDED = "_subscriber_options"  # the namespace attribute naming the fields a parser has
_KEY_FLAGS = ("--server-key", "--client-secret-key")


def match_pair(text: str) -> tuple[str, Any]:
    """``--match split=train``: a (key, value) pair. A value that reads as a JSON number
    or true/false (or a quoted string) is taken as that, any other as text."""
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. split=train; got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    if not isinstance(value, (str, int, float, bool)):
        value = raw
    return key.strip(), value


@dataclass(frozen=True)
class SubscriberOptions:
    """A subscriber's command-line options, checked when built (errors name the flag)."""

    connect: str | None = field(default=None, metadata=flag(metavar="ADDR"))
    """publisher address, e.g. ipc:///tmp/actbus.sock or tcp://HOST:5555; several
    (fan-in): A,B,C, a rank range ipc:///tmp/actbus-{0..3}.sock, or @FILE (one
    endpoint a line, re-read when it changes)"""
    policy: str = "block"
    """what the publisher does when this subscriber falls behind: block, drop_newest,
    drop_oldest, sample:N (every N-th step), sample:FRACTION, sample:R/s (at most R steps
    a second) or spill[:MB[:FALLBACK]] (to the publisher's disk, then FALLBACK)"""
    window: int = 64
    """credit: messages in flight"""
    window_mb: float = 128.0
    """credit: MiB in flight"""
    match: dict[str, Any] | None = field(
        default=None,
        metadata=flag(metavar="KEY=VALUE", action="append", type=match_pair),
    )
    """keep only requests whose tag KEY has VALUE (cut out at the publisher); repeat for
    more keys (all must match), repeat a KEY to accept any of its values"""
    group: str = ""
    """share the stream with the other subscribers of this group, each message going to
    one of them (load-balanced); empty: receive everything"""
    name: str = ""
    """this subscriber's name in the publisher's stats (`actbus stats`)"""
    layers: tuple[int, ...] | None = field(default=None, metadata=flag("--layers", "--layer"))
    """layers wanted, 0-based; all when not given"""
    hooks: tuple[str, ...] | None = field(default=None, metadata=flag("--hooks", "--hook"))
    """hooks wanted (pre_attn, post_attn, mlp_out, post_block); all when not given"""
    server_key: str | None = None
    """CURVE: the publisher's public key file (server.key from `actbus keys`)"""
    client_secret_key: str | None = None
    """CURVE: this subscriber's secret key file (NAME.key_secret from `actbus keys`)"""

    def __post_init__(self) -> None:
        if self.connect is not None:
            Endpoints.parse(self.connect)
        try:
            parse_policy(self.policy)
        except ValueError as e:
            raise ConfigError(f"--policy: {e}") from None
        if not 1 <= self.window <= MAX_WINDOW:
            raise ConfigError(
                f"--window must be at least 1 (messages in flight) and at most {MAX_WINDOW}, "
                f"got {self.window}"
            )
        if not 0 < self.window_mb <= MAX_WINDOW_MB:
            raise ConfigError(
                f"--window-mb must be above 0 (MiB in flight) and at most {MAX_WINDOW_MB:.0f}, "
                f"got {self.window_mb}"
            )
        if self.match is not None:
            try:
                parse_match(json.dumps(self.match))
            except (ValueError, TypeError) as e:
                raise ConfigError(f"--match: {e}") from None
        for name in ("group", "name"):
            if len(getattr(self, name)) > MAX_NAME:
                raise ConfigError(f"--{name}: at most {MAX_NAME} characters")
        if self.layers is not None:  # sorted, without repeats (frozen: set once, here)
            object.__setattr__(self, "layers", parse_layers(list(self.layers), "--layers"))
        if self.hooks is not None:
            object.__setattr__(self, "hooks", parse_hooks(list(self.hooks), "--hooks"))
        self.client_auth()

    # ------------------------------------------------------------------ the parser
    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        *,
        only: Collection[str] | None = None,
        exclude: Collection[str] = (),
        defaults: Mapping[str, Any] | None = None,
        required: Collection[str] = ("connect",),
    ) -> None:
        """Add the flags of these options (``only`` these fields, none of ``exclude``),
        with this command's ``defaults`` (``{"policy": "sample:5/s"}``)."""
        add_fields(parser, cls, only=only, exclude=exclude, defaults=defaults, required=required)
        names = [f.name for f in fields(cls) if (only is None or f.name in only)]
        names = [n for n in names if n not in exclude]
        if "match" in names:  # the old spelling, JSON; warns (see from_args)
            parser.add_argument("--tags", dest="_tags_json", default=None, help=argparse.SUPPRESS)
        parser.set_defaults(**{_ADDED: (*(parser.get_default(_ADDED) or ()), *names)})

    @classmethod
    def from_args(
        cls, ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None
    ) -> SubscriberOptions:
        """The options ``add_arguments`` put in ``ns``; a bad one ends the command with
        ``parser``'s error naming the flag (or raises ``ConfigError`` without a parser)."""
        try:
            kw = {name: getattr(ns, name) for name in getattr(ns, _ADDED, ())}
            if "match" in kw:
                kw["match"] = _match(kw["match"], getattr(ns, "_tags_json", None))
            return cls(**kw)
        except ConfigError as e:
            if parser is None:
                raise
            parser.error(name_flag(parser, str(e), ns))
            raise  # not reached: parser.error exits

    # ------------------------------------------------------------------ products
    @property
    def window_bytes(self) -> int:
        return int(self.window_mb * (1 << 20))

    @property
    def keys(self) -> dict[str, str | None]:
        """The CURVE key files, as ``Subscriber`` and ``consumer.run`` take them."""
        return {"server_key": self.server_key, "client_secret_key": self.client_secret_key}

    def client_auth(self) -> ClientAuth:
        """The CURVE client side (checks both key files, naming the flags)."""
        return ClientAuth(self.connect or "", **self.keys, fields=_KEY_FLAGS)

    def subscription(self, **override: Any) -> Subscription:
        """The subscription these options ask for; ``override`` sets other fields
        (``returned_only``) or replaces these (``group``, ``name``)."""
        kw: dict[str, Any] = {
            **parse_policy(self.policy),
            "window": self.window,
            "window_bytes": self.window_bytes,
            "layers": self.layers,
            "hooks": self.hooks,
            "match": self.match,
            "group": self.group,
            "name": self.name,
        }
        return Subscription(**{**kw, **override})

    def consumer_subscription(self, consumer: Any) -> Subscription:
        """What consumer plugin ``consumer`` (an ``actbus.consumer.Consumer``) asks for
        with these options: its ``subscription`` hook picks layers, hooks and its name."""
        sub = consumer.subscription(
            policy=self.policy,
            window=self.window,
            window_bytes=self.window_bytes,
            match=self.match,
            group=self.group,
        )
        return dataclasses.replace(sub, name=self.name) if self.name else sub

    @property
    def endpoints(self) -> Endpoints:
        """The publishers ``--connect`` names (one, or several: fan-in)."""
        if self.connect is None:
            raise ConfigError("--connect: required; give the publisher's address")
        return Endpoints.parse(self.connect)

    def subscribe(
        self, subscription: Subscription, *, waiting_for: str | None = None
    ) -> Subscriber | FanIn:
        """The stream of ``subscription`` from ``connect``'s publishers, with these keys:
        a ``Subscriber``, or a ``FanIn`` for several (``actbus.bus.fanin.subscribe``);
        ``waiting_for``: what its log lines say it is for (``Subscriber``)."""
        from actbus.bus.fanin import subscribe

        return subscribe(self.endpoints, subscription, waiting_for=waiting_for, **self.keys)


def _match(pairs: list[tuple[str, Any]] | None, tags_json: str | None) -> dict[str, Any] | None:
    """``--match`` pairs as a filter (a repeated key accepts any of its values), or the
    deprecated ``--tags JSON``."""
    if tags_json is not None:
        if pairs:
            raise ConfigError("--tags: give --match only (--tags is its old spelling, in JSON)")
        log.warning("--tags is deprecated and will be removed; use --match KEY=VALUE (repeatable)")
        try:
            return parse_match(tags_json)
        except ValueError as e:
            raise ConfigError(f"--tags: {e}") from None
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key not in out:
            out[key] = value
            continue
        seen = out[key] if isinstance(out[key], list) else [out[key]]
        if not any(type(v) is type(value) and v == value for v in seen):  # 1 is not True
            out[key] = [*seen, value]
    return out


def add_end_arguments(group: Any) -> None:
    """``--keep-waiting`` (and ``--exit-on-end``, the default, kept for scripts): whether
    a consumer command ends with its stream. By default it exits 0 once the stream has
    ended: its publisher sent END (a clean stop of ``actbus serve``), or under fan-in
    every publisher did (never with ``@FILE``, whose fleet may grow). A publisher that
    died without END is waited for either way."""
    end = group.add_mutually_exclusive_group()
    end.add_argument(
        "--keep-waiting",
        dest="exit_on_end",
        action="store_false",
        help="when the publisher ends its stream, wait for one to start again at the "
        "address (by default the command exits once the stream ended)",
    )
    end.add_argument(
        "--exit-on-end",
        dest="exit_on_end",
        action="store_true",
        help="exit when the publisher ends its stream (the default)",
    )
    group.set_defaults(exit_on_end=True)
