"""Backpressure policies: what the publisher does for a subscriber that falls behind.

The names follow Vector's ``when_full`` (``block``, ``drop_newest``): ``block`` is
lossless and makes the publisher, and so the engine, wait for that subscriber.
``drop_oldest`` evicts the oldest waiting message instead (fresh data for
trainers); ``sample`` takes every N-th step, or at most R steps a second, and drops
the newest when full (dashboards: ``sample:R/s`` bounds what watching costs the
engine however fast it steps, where every N-th step costs more the faster it
runs); ``spill`` writes what does not fit to local disk and replays it in order,
up to a byte cap, after which its fallback policy applies.

Each policy is one class; routing (``routing.py``) asks it four things and never
its name: is it ``lossless``, does it ``skips`` a step, how much ``room`` it has
before it would drop, and what happens ``on_full`` (a message that does not fit).
A policy object belongs to one subscriber (a rate sampler remembers the steps it
took). It reads as the ``Subscription`` fields it sets, which are its HELLO wire
fields, so ``Subscription(**parse_policy(text))`` works; ``str(policy)`` is its
canonical text. A new policy is one class with ``@register``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from actbus.bus.protocol import Subscription
    from actbus.bus.routing import Item, Route

log = logging.getLogger("actbus.publisher")

Clock = Callable[[], float]
SPILL_FALLBACKS = ("drop_newest", "drop_oldest", "block")
DEFAULT_SPILL_MB = 1024.0
MAX_SPILL_MB = float(1 << 20)  # 1 TiB
MAX_SAMPLE_PER_S = 1e6
# Steps a sample:R/s subscriber remembers taking: routing may lag the engine by this many.
RATE_STEPS_KEPT = 4096
UNBOUNDED = 1 << 30
"""``room`` of a policy that never drops the newest message."""


class Policy(Mapping[str, Any]):
    """One subscriber's backpressure policy (a subclass per policy)."""

    name: ClassVar[str]
    """The wire ``policy`` field, and the first word of the text form."""
    usage: ClassVar[tuple[str, ...]] = ()
    """Text forms shown when a policy string is not understood (default: ``name``)."""
    lossless: bool = False
    """Never drops: it may make the publisher, and so the engine, wait."""

    # ----------------------------------------------------------------- parsing
    @classmethod
    def parse(cls, arg: str, text: str, clock: Clock) -> Policy:
        """The policy from the text after ``name:`` (``arg``); ``text`` is the whole."""
        if arg:
            raise ValueError(f"unknown policy {text!r}; {_usage()}")
        return cls()

    @classmethod
    def from_subscription(cls, sub: Subscription, clock: Clock) -> Policy:
        """The policy from a (checked) subscription's fields."""
        return cls()

    def fields(self) -> dict[str, Any]:
        """The ``Subscription`` (and HELLO wire) fields that select this policy."""
        return {"policy": self.name}

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __getitem__(self, key: str) -> Any:
        return self.fields()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields())

    def __len__(self) -> int:
        return len(self.fields())

    # ------------------------------------------------------------------ routing
    def skips(self, step: int) -> bool:
        """A step it does not take: neither a drop nor a gap (``sampled_out``)."""
        return False

    def room(self, route: Route, step: int, nbytes: int) -> int:
        """How many more messages of ``step`` (``nbytes`` each) it takes now without
        dropping one, before what is queued for it ahead of them. Read from the engine
        thread without a lock: a stale answer only moves a drop between the engine
        (at the source) and the publisher thread; both are counted."""
        return UNBOUNDED

    def holds(self, route: Route, item: Item) -> bool:
        """True when taking ``item`` now would break a lossless promise: the shared
        queue waits (and with it, once its byte budget is spent, the engine)."""
        return False

    def on_full(self, route: Route, seq: int, m: Item) -> bool:
        """``m`` (numbered ``seq``) does not fit in ``route``'s memory queue: act and
        count. True: queue it in memory anyway; False: it was dropped or stored."""
        route.c.dropped["queue_full"] += 1  # its seq is skipped: a visible gap
        return False


POLICIES: dict[str, type[Policy]] = {}
"""Every policy by wire name, in the order they are offered."""


def register(cls: type[Policy]) -> type[Policy]:
    """Make a policy class known by its ``name`` (to parsing and to the wire)."""
    POLICIES[cls.name] = cls
    return cls


@register
class Block(Policy):
    """Lossless: when its memory queue is full, the shared queue waits for it."""

    name = "block"
    lossless = True

    def holds(self, route: Route, item: Item) -> bool:
        return route.backed_up

    def on_full(self, route: Route, seq: int, m: Item) -> bool:
        return True  # ``holds`` kept the queue until there was room


@register
class DropNewest(Policy):
    """The new message is dropped when its queue and credit are full."""

    name = "drop_newest"

    def room(self, route: Route, step: int, nbytes: int) -> int:
        return route.room(nbytes)


@register
class DropOldest(Policy):
    """The oldest waiting message is evicted for the new one (fresh data)."""

    name = "drop_oldest"

    def on_full(self, route: Route, seq: int, m: Item) -> bool:
        route.pending.popleft()  # the oldest unsent one leaves a gap instead
        route.c.dropped["evicted"] += 1
        return True


@register
class Sample(DropNewest):
    """Takes some steps only (``SampleEvery``, ``SampleRate``); drops the newest when
    full. Parses both text forms of ``sample``."""

    name = "sample"
    usage = ("sample:N", "sample:R/s")

    @classmethod
    def parse(cls, arg: str, text: str, clock: Clock) -> Policy:
        if arg.endswith("/s"):
            try:
                rate = float(arg[:-2])
            except ValueError:
                raise ValueError(
                    f"sample:R/s needs a number of steps per second, got {text!r}"
                ) from None
            if not 0 < rate <= MAX_SAMPLE_PER_S:
                raise ValueError(
                    f"sample:R/s needs R in (0, {MAX_SAMPLE_PER_S:.0f}] steps per second, "
                    f"got {text!r}"
                )
            return SampleRate(rate, clock)
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
        return SampleEvery(max(1, every))

    @classmethod
    def from_subscription(cls, sub: Subscription, clock: Clock) -> Policy:
        if sub.sample_per_s > 0:
            return SampleRate(sub.sample_per_s, clock)
        return SampleEvery(sub.sample_every)

    def room(self, route: Route, step: int, nbytes: int) -> int:
        return 0 if self.skips(step) else route.room(nbytes)


class SampleEvery(Sample):
    """``sample:N``: steps whose number is a multiple of N."""

    def __init__(self, every: int) -> None:
        self.every = every

    def fields(self) -> dict[str, Any]:
        return {"policy": self.name, "sample_every": self.every}

    def __str__(self) -> str:
        return f"sample:{self.every}"

    def skips(self, step: int) -> bool:
        return step % self.every != 0


class SampleRate(Sample):
    """``sample:R/s``: the first step seen at least 1/R s after the last one taken.

    Decided once per step, by whichever thread meets the step first (the engine's
    ``admit``, or routing for a message published without it), so that copying and
    routing agree on it. ``clock`` is injectable (tests step it by hand).
    """

    def __init__(self, per_s: float, clock: Clock = time.monotonic) -> None:
        self.per_s = per_s
        self.period = 1.0 / per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._decided = -1  # the newest step decided
        self._due = -math.inf
        self._taken: set[int] = set()
        self._order: deque[int] = deque()  # taken steps, oldest first (to forget them)

    def fields(self) -> dict[str, Any]:
        return {"policy": self.name, "sample_per_s": self.per_s}

    def __str__(self) -> str:
        return f"sample:{self.per_s:g}/s"

    def skips(self, step: int) -> bool:
        if step > self._decided:
            with self._lock:
                if step > self._decided:
                    now = self._clock()
                    if now >= self._due:
                        self._due = now + self.period
                        self._taken.add(step)
                        self._order.append(step)
                        if len(self._order) > RATE_STEPS_KEPT:
                            self._taken.discard(self._order.popleft())
                    self._decided = step  # last: a reader that sees it finds the verdict
        return step not in self._taken


@register
class Spill(Policy):
    """What does not fit goes to the publisher's disk and is replayed in order, up
    to ``mb`` MiB; past that its fallback applies: ``drop_newest`` (the new one is
    dropped), ``drop_oldest`` (the oldest spilled ones are evicted) or ``block``
    (lossless: the shared queue waits until it fits)."""

    name = "spill"
    usage = ("spill[:MB[:FALLBACK]]",)

    def __init__(self, mb: float = DEFAULT_SPILL_MB, fallback: str = "drop_newest") -> None:
        if fallback not in SPILL_FALLBACKS:
            raise ValueError(
                f"spill fallback {fallback!r} is unknown; choose {', '.join(SPILL_FALLBACKS)}"
            )
        self.mb = mb
        self.fallback = fallback
        self.cap = int(mb * (1 << 20))
        self.lossless = fallback == "block"
        self._evicts = fallback == "drop_oldest"

    @classmethod
    def parse(cls, arg: str, text: str, clock: Clock) -> Policy:
        mb_text, _, fallback = arg.partition(":")
        try:
            mb = float(mb_text) if mb_text else DEFAULT_SPILL_MB
        except ValueError:
            raise ValueError(
                f"spill needs a cap in MiB, as spill:MB[:FALLBACK], got {text!r}"
            ) from None
        if not 0 < mb <= MAX_SPILL_MB:
            raise ValueError(f"spill cap must be in (0, {MAX_SPILL_MB:.0f}] MiB, got {text!r}")
        return cls(mb, fallback or "drop_newest")

    @classmethod
    def from_subscription(cls, sub: Subscription, clock: Clock) -> Policy:
        return cls(sub.spill_mb, sub.spill_fallback)

    def fields(self) -> dict[str, Any]:
        return {"policy": self.name, "spill_mb": self.mb, "spill_fallback": self.fallback}

    def __str__(self) -> str:
        return f"spill:{self.mb:g}:{self.fallback}"

    def holds(self, route: Route, item: Item) -> bool:
        if not self.lossless:
            return False
        held = route.spill.nbytes if route.spill is not None else 0
        return route.full(item.nbytes) and held + item.wire_bytes > self.cap

    def on_full(self, route: Route, seq: int, m: Item) -> bool:
        spill = route.spill_log(self)
        size, cap = m.wire_bytes, self.cap
        if spill.nbytes + size > cap and not self.lossless:
            if self._evicts:
                while spill and spill.nbytes + size > cap:
                    spill.discard()  # the oldest spilled one leaves a gap
                    route.c.dropped["spill_full"] += 1
            if spill.nbytes + size > cap:
                route.c.dropped["spill_full"] += 1
                return False
        # Lossless: ``holds`` kept the shared queue until this fitted.
        try:
            spill.append(seq, m.header.step, m.header_bytes, m.payload)
        except OSError as e:
            log.error("actbus: spill for %s failed (%s); message dropped", route.sub.name, e)
            route.c.dropped["spill_error"] += 1
            return False
        route.c.spilled += 1
        return False


def _usage() -> str:
    forms = [form for cls in POLICIES.values() for form in (cls.usage or (cls.name,))]
    return f"choose {', '.join(forms[:-1])} or {forms[-1]}"


def parse_policy(text: str, *, clock: Clock = time.monotonic) -> Policy:
    """A policy string -> its policy object (which reads as the ``Subscription``
    fields it sets).

    ``"sample:10"`` / ``"sample:0.1"`` -> every 10th step; ``"sample:5/s"`` -> at most
    5 steps a second; ``"spill:512:drop_oldest"``
    -> spill up to 512 MiB, then evict the oldest spilled (``spill`` alone: 1024 MiB,
    then ``drop_newest``).
    """
    name, _, arg = text.partition(":")
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {text!r}; {_usage()}")
    return cls.parse(arg, text, clock)


def policy_of(sub: Subscription, *, clock: Clock = time.monotonic) -> Policy:
    """The policy a subscription (checked by ``Subscription.from_wire``) asks for."""
    return POLICIES[sub.policy].from_subscription(sub, clock)
