"""Subscription handshake: what a subscriber asks for and how it is checked.

A subscriber names the layers and hooks it wants, a request filter (``match``), a
backpressure policy (``policies.py``: its HELLO fields are ``policy``,
``sample_every``, ``sample_per_s``, ``spill_mb`` and ``spill_fallback``), its
credit window and, optionally, a load-balancing group. The publisher checks every
field of a HELLO and refuses a bad one by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgpack

from actbus.bus.policies import (
    DEFAULT_SPILL_MB,
    MAX_SAMPLE_PER_S,
    MAX_SPILL_MB,
    POLICIES,
    SPILL_FALLBACKS,
    parse_policy,
)
from actbus.wire import NAMED_ONLY_HOOKS, SCHEMA_VERSION, WireError

__all__ = [
    "DASHBOARD_POLICY",
    "POLICIES",
    "Subscription",
    "parse_match",
    "parse_policy",
]

MAX_WINDOW = 1024
"""Credit in messages a subscriber may ask for: the publisher's per-peer ZeroMQ queue
holds this many data messages plus room for session messages (``publisher.py``)."""
MAX_VIEWING = 4 * MAX_WINDOW
"""Seqs a HELLO or BYE may name in ``viewing`` (messages whose rows a subscriber still
views; one holding more names none, and all its blocks are kept)."""
MAX_WINDOW_BYTES = 1 << 40
"""Credit in bytes the wire accepts; each publisher caps it lower (``max_window_mb``)."""
MIN_FRAME_BYTES = 1 << 20
"""The least a subscriber accepts in one frame: room for session messages (a STATS
reply is about 300 bytes a subscriber) and for messages above a small byte window."""
SESSION_ROOM = 256
"""Session messages (heartbeats, marks, stats) a subscriber's socket holds unread
beyond its credit: 128 s of heartbeats at the default period while its consumer is
busy, after which the publisher's own queue for it fills, as before."""


def recv_queue(window: int) -> int:
    """Messages a subscriber's socket holds received and unread (its ZMQ_RCVHWM): its
    credit and ``SESSION_ROOM``. What a publisher sends past that waits in the
    publisher's queue for it (which drops a peer whose queue fills), never in the
    subscriber's memory."""
    return window + SESSION_ROOM


def frame_limit(window_bytes: int) -> int:
    """The largest frame a subscriber with this byte credit accepts (its
    ZMQ_MAXMSGSIZE: a larger one closes the connection before it is allocated). The
    publisher never sends one over it: such a message is dropped for that subscriber
    and counted (``oversized``). So a publisher, hostile or not, costs a subscriber at
    most ``recv_queue`` frames of this size, however far it floods past credit."""
    return max(window_bytes, MIN_FRAME_BYTES)


MAX_NAME = 200
MAX_MATCH_KEYS = 64
MAX_MATCH_BYTES = 8192
"""A request filter's size, msgpack-encoded: what a subscriber may make the publisher
check every request of every message against."""
_SCALARS = (str, int, float, bool)
DASHBOARD_POLICY = "sample:5/s"
"""Dashboards' default: at most 5 steps a second, a fixed small cost to the engine
however fast it steps (every N-th step costs more the faster it runs), and plenty
for statistics refreshed every second or two."""


@dataclass(frozen=True)
class Subscription:
    """A subscriber's request, sent in HELLO."""

    policy: str = "block"
    """The backpressure policy's name (``policies.py``); with the four fields below,
    what ``parse_policy`` sets."""
    sample_every: int = 1
    """With ``policy="sample"``: take steps whose number is a multiple of this."""
    sample_per_s: float = 0.0
    """With ``policy="sample"``, if set: take at most this many steps a second (the
    first step due after the last one taken) instead of every ``sample_every``-th."""
    window: int = 64
    """Credit in messages: how many the publisher may send ahead of acknowledgements."""
    window_bytes: int = 128 << 20
    """Credit in bytes; whichever of the two runs out first holds sending back. A
    message larger than this still goes when nothing else is in flight."""
    layers: tuple[int, ...] | None = None
    """Layers wanted (None: all; ``()``: none, e.g. a stats client)."""
    hooks: tuple[str, ...] | None = None
    match: dict[str, Any] | None = None
    """Keep only requests whose tags match every key: ``{"split": "train"}``; a list
    value accepts any of its values: ``{"lang": ["en", "fr"]}``. Other rows are cut
    out at the publisher (a filtered message is a copy; unfiltered ones are not).
    Sent in HELLO under the key ``"tags"``."""
    returned_only: bool = False
    """Keep only the rows of requests whose caller asked for them back
    (``extra_args["actbus"]["return"]``): the front end's own subscriber."""
    group: str = ""
    """Load-balancing group: each message for the group goes to exactly one live
    member (the least loaded one with credit). Empty: this subscriber gets everything."""
    spill_mb: float = DEFAULT_SPILL_MB
    """With ``policy="spill"``: MiB of backlog kept on the publisher's disk."""
    spill_fallback: str = "drop_newest"
    """With ``policy="spill"``: what happens once ``spill_mb`` is full."""
    name: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "policy": self.policy,
            "sample_every": self.sample_every,
            "sample_per_s": self.sample_per_s,
            "window": self.window,
            "window_bytes": self.window_bytes,
            "layers": list(self.layers) if self.layers is not None else None,
            "hooks": list(self.hooks) if self.hooks is not None else None,
            "tags": dict(self.match) if self.match else None,
            "returned_only": self.returned_only,
            "group": self.group,
            "spill_mb": self.spill_mb,
            "spill_fallback": self.spill_fallback,
            "name": self.name,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Subscription:
        """Check every field; a bad one is refused with its name and the fix."""
        schema = d.get("schema")
        if schema != SCHEMA_VERSION:
            raise WireError(
                f"subscriber speaks schema {schema!r}, publisher speaks {SCHEMA_VERSION}; "
                "install the same actbus version on both sides"
            )
        policy = d.get("policy", "block")
        if not isinstance(policy, str) or policy not in POLICIES:
            raise WireError(f"policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        every = _int(d, "sample_every", 1, 1, 1 << 30)
        per_s = d.get("sample_per_s", 0.0)
        if (
            not isinstance(per_s, (int, float))
            or isinstance(per_s, bool)
            or not 0 <= per_s <= MAX_SAMPLE_PER_S
        ):
            raise WireError(
                f"sample_per_s must be a number of steps per second in [0, "
                f"{MAX_SAMPLE_PER_S:.0f}] (0: every sample_every-th step), got {per_s!r:.50}"
            )
        window = _int(d, "window", 64, 1, MAX_WINDOW)
        window_bytes = _int(d, "window_bytes", 128 << 20, 1, MAX_WINDOW_BYTES)
        layers = d.get("layers")
        if layers is not None and (
            not isinstance(layers, list)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            raise WireError(f"layers must be a list of ints or null, got {layers!r:.200}")
        hooks = d.get("hooks")
        if hooks is not None and (
            not isinstance(hooks, list) or not all(isinstance(x, str) for x in hooks)
        ):
            raise WireError(f"hooks must be a list of strings or null, got {hooks!r:.200}")
        match = d.get("tags")
        if match is not None:
            _check_match(match)
        returned_only = d.get("returned_only", False)
        if not isinstance(returned_only, bool):
            raise WireError(f"returned_only must be true or false, got {returned_only!r:.50}")
        group = d.get("group", "")
        if not isinstance(group, str) or len(group) > MAX_NAME:
            raise WireError(f"group must be a string of at most {MAX_NAME} characters")
        spill_mb = d.get("spill_mb", DEFAULT_SPILL_MB)
        if (
            not isinstance(spill_mb, (int, float))
            or isinstance(spill_mb, bool)
            or not 0 < spill_mb <= MAX_SPILL_MB
        ):
            raise WireError(
                f"spill_mb must be a number in (0, {MAX_SPILL_MB:.0f}] (MiB), got {spill_mb!r:.50}"
            )
        fallback = d.get("spill_fallback", "drop_newest")
        if fallback not in SPILL_FALLBACKS:
            raise WireError(
                f"spill_fallback {fallback!r} is unknown; choose {', '.join(SPILL_FALLBACKS)}"
            )
        name = d.get("name", "")
        return cls(
            policy=policy,
            sample_every=every,
            sample_per_s=float(per_s),
            window=window,
            window_bytes=window_bytes,
            layers=tuple(layers) if layers is not None else None,
            hooks=tuple(hooks) if hooks is not None else None,
            match=dict(match) if match else None,
            returned_only=returned_only,
            group=group,
            spill_mb=float(spill_mb),
            spill_fallback=fallback,
            name=str(name)[:MAX_NAME],
        )

    def wants(self, layer: int, hook: str) -> bool:
        """Monitor scores and router rows (``NAMED_ONLY_HOOKS``) go only to subscribers
        that name that hook: ``hooks=None`` means every activation hook, so consumers of
        activations never receive rows of another width."""
        if hook in NAMED_ONLY_HOOKS and (self.hooks is None or hook not in self.hooks):
            return False
        return (self.layers is None or layer in self.layers) and (
            self.hooks is None or hook in self.hooks
        )

    @property
    def filters_requests(self) -> bool:
        """Whether some requests' rows are cut out of messages for it."""
        return bool(self.match) or self.returned_only

    def wants_request(self, tags: dict[str, Any], returned: bool = False) -> bool:
        """True when a request passes the filters: its tags match every key of
        ``match``, and it asked for its rows back if ``returned_only``."""
        if self.returned_only and not returned:
            return False
        return self._match_sets is None or _matches(self._match_sets, tags)

    @cached_property
    def _match_sets(self) -> tuple[tuple[str, frozenset[tuple[bool, Any]]], ...] | None:
        """``match`` compiled once: each key with the set of values it accepts, so a
        request costs one set lookup per key however many values a key lists."""
        if not self.match:
            return None
        return tuple(
            (key, frozenset(_keyed(v) for v in (want if isinstance(want, list) else [want])))
            for key, want in self.match.items()
        )


def _keyed(value: Any) -> tuple[bool, Any]:
    """A tag value as a set member that keeps ``True`` apart from ``1`` (tags come from
    JSON users), while ``1`` and ``1.0`` stay equal."""
    return (type(value) is bool, value)


def _matches(sets: tuple[tuple[str, frozenset[tuple[bool, Any]]], ...], tags: dict) -> bool:
    for key, accepted in sets:
        have = tags.get(key, _MISSING)
        try:
            if _keyed(have) not in accepted:
                return False
        except TypeError:  # a list or map tag: never equal to the scalars a filter holds
            return False
    return True


_MISSING = object()


def _int(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError(f"{key} must be an int in {lo}..{hi}, got {v!r:.100}")
    return v


def _check_match(match: Any) -> None:
    """A request filter, as the wire and ``parse_match`` take it (errors name its wire
    key, ``tags``)."""
    if not isinstance(match, dict) or len(match) > MAX_MATCH_KEYS:
        raise WireError(
            f"tags must be a map of at most {MAX_MATCH_KEYS} keys, e.g. {{'split': 'train'}}"
        )
    try:
        size = len(msgpack.packb(match, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        size = 0  # not scalars: refused below, by key
    if size > MAX_MATCH_BYTES:
        raise WireError(
            f"tags (the request filter) is {size} bytes encoded; at most {MAX_MATCH_BYTES} "
            "are accepted: filter on fewer keys or values"
        )
    for k, v in match.items():
        ok = isinstance(v, _SCALARS) or (
            isinstance(v, list) and 0 < len(v) <= 1024 and all(isinstance(x, _SCALARS) for x in v)
        )
        if not isinstance(k, str) or not ok:
            raise WireError(
                f"tags[{k!r:.50}] must be a string key with a scalar or a non-empty list of "
                "scalars (accepted values)"
            )


def parse_match(text: str) -> dict[str, Any]:
    """A request filter from JSON text, e.g. ``'{"split": "train", "lang": ["en", "fr"]}'``."""
    try:
        match = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f'tags must be a JSON object such as {{"split": "train"}}: {e}') from None
    try:
        _check_match(match)
    except WireError as e:
        raise ValueError(str(e)) from None
    return match
