"""Subscription handshake: what a subscriber asks for and how it is checked.

The publisher enforces each subscriber's policy; the names follow Vector's
``when_full`` (``block``, ``drop_newest``): ``block`` is lossless and makes the
publisher, and so the engine, wait for that subscriber. ``drop_oldest`` evicts the
oldest waiting message instead (fresh data for trainers); ``sample`` takes every
N-th step, or at most R steps a second, and drops the newest when full
(dashboards: ``sample:R/s`` bounds what watching costs the engine however fast it
steps, where every N-th step costs more the faster it runs); ``spill`` writes what does
not fit to local disk and replays it in order, up to a byte cap, after which its
fallback policy applies.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from actbus.wire import SCHEMA_VERSION, WireError

POLICIES = ("block", "drop_newest", "drop_oldest", "sample", "spill")
SPILL_FALLBACKS = ("drop_newest", "drop_oldest", "block")
DEFAULT_SPILL_MB = 1024.0
MAX_SPILL_MB = float(1 << 20)  # 1 TiB
MAX_WINDOW = 1 << 20
MAX_NAME = 200
MAX_TAGS = 64
MAX_SAMPLE_PER_S = 1e6
_SCALARS = (str, int, float, bool)
DASHBOARD_POLICY = "sample:5/s"
"""Dashboards' default: at most 5 steps a second, a fixed small cost to the engine
however fast it steps (every N-th step costs more the faster it runs), and plenty
for statistics refreshed every second or two."""
_USAGE = "choose block, drop_newest, drop_oldest, sample:N, sample:R/s or spill[:MB[:FALLBACK]]"


def parse_policy(text: str) -> dict[str, Any]:
    """A policy string -> the ``Subscription`` fields it sets.

    ``"sample:10"`` / ``"sample:0.1"`` -> every 10th step; ``"sample:5/s"`` -> at most
    5 steps a second; ``"spill:512:drop_oldest"``
    -> spill up to 512 MiB, then evict the oldest spilled (``spill`` alone: 1024 MiB,
    then ``drop_newest``).
    """
    name, _, arg = text.partition(":")
    if name not in POLICIES or (arg and name not in ("sample", "spill")):
        raise ValueError(f"unknown policy {text!r}; {_USAGE}")
    if name == "sample" and arg.endswith("/s"):
        try:
            rate = float(arg[:-2])
        except ValueError:
            raise ValueError(
                f"sample:R/s needs a number of steps per second, got {text!r}"
            ) from None
        if not 0 < rate <= MAX_SAMPLE_PER_S:
            raise ValueError(
                f"sample:R/s needs R in (0, {MAX_SAMPLE_PER_S:.0f}] steps per second, got {text!r}"
            )
        return {"policy": "sample", "sample_per_s": rate}
    if name == "sample":
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(
                f"sample needs N (every N-th step), a fraction or R/s (steps a second), "
                f"got {text!r}"
            ) from None
        if not value > 0 or math.isinf(value):
            raise ValueError(f"sample needs a positive N or fraction, got {text!r}")
        every = round(1 / value) if value < 1 else round(value)
        return {"policy": "sample", "sample_every": max(1, every)}
    if name == "spill":
        mb_text, _, fallback = arg.partition(":")
        try:
            mb = float(mb_text) if mb_text else DEFAULT_SPILL_MB
        except ValueError:
            raise ValueError(
                f"spill needs a cap in MiB, as spill:MB[:FALLBACK], got {text!r}"
            ) from None
        if not 0 < mb <= MAX_SPILL_MB:
            raise ValueError(f"spill cap must be in (0, {MAX_SPILL_MB:.0f}] MiB, got {text!r}")
        fallback = fallback or "drop_newest"
        if fallback not in SPILL_FALLBACKS:
            raise ValueError(
                f"spill fallback {fallback!r} is unknown; choose {', '.join(SPILL_FALLBACKS)}"
            )
        return {"policy": "spill", "spill_mb": mb, "spill_fallback": fallback}
    return {"policy": name}


@dataclass(frozen=True)
class Subscription:
    """A subscriber's request, sent in HELLO."""

    policy: str = "block"
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
    tags: dict[str, Any] | None = None
    """Keep only requests whose tags match every key: ``{"split": "train"}``; a list
    value accepts any of its values: ``{"lang": ["en", "fr"]}``. Other rows are cut
    out at the publisher (a filtered message is a copy; unfiltered ones are not)."""
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
            "tags": dict(self.tags) if self.tags else None,
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
        if policy not in POLICIES:
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
        window_bytes = _int(d, "window_bytes", 128 << 20, 1, 1 << 40)
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
        tags = d.get("tags")
        if tags is not None:
            _check_tags(tags)
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
            tags=dict(tags) if tags else None,
            returned_only=returned_only,
            group=group,
            spill_mb=float(spill_mb),
            spill_fallback=fallback,
            name=str(name)[:MAX_NAME],
        )

    def wants(self, layer: int, hook: str) -> bool:
        return (self.layers is None or layer in self.layers) and (
            self.hooks is None or hook in self.hooks
        )

    @property
    def filters_requests(self) -> bool:
        """Whether some requests' rows are cut out of messages for it."""
        return bool(self.tags) or self.returned_only

    def wants_request(self, tags: dict[str, Any], returned: bool = False) -> bool:
        """True when a request passes the filters: its tags match every key of the
        tag filter, and it asked for its rows back if ``returned_only``."""
        if self.returned_only and not returned:
            return False
        if not self.tags:
            return True
        for key, want in self.tags.items():
            have = tags.get(key, _MISSING)
            if isinstance(want, list):
                if not any(_same(have, w) for w in want):
                    return False
            elif not _same(have, want):
                return False
        return True


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps ``True`` and ``1`` apart (tags come from JSON users)."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _int(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError(f"{key} must be an int in {lo}..{hi}, got {v!r:.100}")
    return v


def _check_tags(tags: Any) -> None:
    if not isinstance(tags, dict) or len(tags) > MAX_TAGS:
        raise WireError(f"tags must be a map of at most {MAX_TAGS} keys, e.g. {{'split': 'train'}}")
    for k, v in tags.items():
        ok = isinstance(v, _SCALARS) or (
            isinstance(v, list) and 0 < len(v) <= 1024 and all(isinstance(x, _SCALARS) for x in v)
        )
        if not isinstance(k, str) or not ok:
            raise WireError(
                f"tags[{k!r:.50}] must be a string key with a scalar or a non-empty list of "
                "scalars (accepted values)"
            )


def parse_tags(text: str) -> dict[str, Any]:
    """A tag filter from JSON text, e.g. ``'{"split": "train", "lang": ["en", "fr"]}'``."""
    try:
        tags = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f'tags must be a JSON object such as {{"split": "train"}}: {e}') from None
    try:
        _check_tags(tags)
    except WireError as e:
        raise ValueError(str(e)) from None
    return tags
