"""Consumer plugins: subscribers that do something with the stream.

A consumer subclasses ``Consumer`` and is registered under the
``actbus.consumers`` entry-point group; ``actbus run NAME`` finds it there, lets
it add its own command-line flags, subscribes with its policy and feeds it. A
consumer that raises is reported and stopped or restarted (``RestartPolicy``);
the publisher only sees a subscriber leave, and a new one join.
"""

from __future__ import annotations

import argparse
import gc
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar

from actbus.bus import Batch, Event, Subscriber, Subscription
from actbus.bus.fanin import FanIn, per_publisher, subscribe
from actbus.bus.protocol import parse_policy

log = logging.getLogger("actbus.consumer")
GROUP = "actbus.consumers"


class Consumer(ABC):
    """Base class of consumer plugins."""

    name: ClassVar[str] = ""
    default_policy: ClassVar[str] = "block"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this consumer's own flags."""

    @classmethod
    @abstractmethod
    def from_args(cls, args: argparse.Namespace) -> Consumer:
        """Build the consumer from parsed flags."""

    def subscription(
        self,
        policy: str | None = None,
        window: int = 64,
        window_bytes: int = 128 << 20,
        match: dict[str, Any] | None = None,
        group: str = "",
    ) -> Subscription:
        """What to ask the publisher for; override to filter layers or hooks.

        ``policy`` is a policy string (``sample:N``, ``spill:MB:FALLBACK``...);
        ``match`` keeps only matching requests; ``group`` shares the stream with the
        group's other members (load-balanced) instead of receiving all of it.
        """
        return Subscription(
            **parse_policy(policy or self.default_policy),
            window=window,
            window_bytes=window_bytes,
            match=match,
            group=group,
            name=self.name,
        )

    def on_welcome(self, info: dict[str, Any]) -> None:
        """The publisher accepted the subscription; ``info`` describes the stream."""

    @abstractmethod
    def on_batch(self, batch: Batch) -> None:
        """One step of one (layer, hook)."""

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        """Called on each publisher heartbeat; ``caught_up`` when nothing is in flight."""

    def on_mark(self, info: dict[str, Any]) -> None:
        """A subscriber marked a request as worth keeping (``Subscriber.mark``);
        ``info`` holds ``request_id``, ``sample_index``, ``reason`` and ``by``."""

    def on_end(self) -> None:
        """The publisher shut down (the engine stopped)."""

    def on_rejected(self, rejected_by: dict[str, int]) -> None:
        """The subscriber refused messages that broke the schema or a bound (logged
        there, never delivered); ``rejected_by`` is the running total by the header
        field at fault, given after each new refusal."""

    def close(self) -> None:
        """Release resources; called once, last."""


def available() -> dict[str, str]:
    """Registered consumer names and the objects they point at."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def load(name: str) -> type[Consumer]:
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in eps:
        known = ", ".join(sorted(eps)) or "(none installed)"
        raise KeyError(f"no consumer named {name!r}; installed: {known}")
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Consumer)):
        raise TypeError(f"entry point {name!r} does not name a Consumer subclass")
    return cls


ON_ERROR = ("stop", "restart")


class ConsumerFailed(RuntimeError):
    """A consumer's callback raised. The bus and the publisher are untouched by it."""

    def __init__(self, consumer: str, callback: str, error: BaseException) -> None:
        super().__init__(
            f"consumer {consumer!r} failed in {callback}: {type(error).__name__}: {error}"
        )
        self.consumer = consumer
        self.callback = callback
        self.error = error


@dataclass(frozen=True)
class RestartPolicy:
    """What ``run`` does when a consumer's callback raises (``actbus run --on-error``).

    ``stop`` ends the run with the error. ``restart`` closes the consumer, builds a
    fresh one and subscribes anew, at most ``max_restarts`` times in all, waiting
    ``backoff_s`` before the first and twice as long before each next one (at most
    30 s), so a consumer that fails at once does not spin. Messages published while
    no instance is subscribed are not kept for it: a restarted consumer joins late.
    """

    on_error: str = "stop"
    max_restarts: int = 5
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error: expected stop or restart, got {self.on_error!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: expected an int >= 0, got {self.max_restarts}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s: expected seconds >= 0, got {self.backoff_s}")


@dataclass
class RunOutcome:
    """How a run ended; counters are summed over every consumer instance."""

    received: int = 0
    missed: int = 0
    rejected: int = 0
    errors: int = 0
    """Callbacks that raised (``close`` included)."""
    restarts: int = 0
    failure: ConsumerFailed | None = None
    """The error that ended the run (``stop``, or restarts used up); None if it ended well."""
    publishers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The last instance's counters by publisher address (``FanIn.per_publisher``)."""


def run(
    make: Callable[[], Consumer],
    address: str,
    *,
    subscription: Callable[[Consumer], Subscription] | None = None,
    restart: RestartPolicy | None = None,
    stop: threading.Event | None = None,
    exit_on_end: bool = False,
    server_key: str | None = None,
    client_secret_key: str | None = None,
) -> RunOutcome:
    """Feed consumers built by ``make`` from the publisher at ``address`` until stopped.

    ``address`` is what ``--connect`` takes: one address, or several publishers
    (``A,B``, a rank range, ``@FILE``), read as one stream (``actbus.bus.fanin``).

    A callback that raises is logged with its traceback and counted, then handled
    by ``restart`` (default: stop). Each instance has its own subscription, closed
    with it, so the publisher sees an ordinary subscriber leave and join. Errors of
    the bus itself (``SubscriptionRejected``, ``ConfigError``) are raised, not
    retried: a fresh consumer would not fix them.
    """
    restart = restart or RestartPolicy()
    stop = stop or threading.Event()
    outcome = RunOutcome()
    delay = restart.backoff_s
    while True:
        failure = _run_once(
            make, address, subscription, stop, exit_on_end, server_key, client_secret_key, outcome
        )
        if failure is None:
            return outcome
        if restart.on_error == "stop" or outcome.restarts >= restart.max_restarts:
            outcome.failure = failure
            return outcome
        outcome.restarts += 1
        log.warning(
            "restarting consumer %r (restart %d of %d) in %.1fs",
            failure.consumer,
            outcome.restarts,
            restart.max_restarts,
            delay,
        )
        if stop.wait(delay):
            return outcome
        delay = min(2 * delay, 30.0)


def _run_once(
    make: Callable[[], Consumer],
    address: str,
    subscription: Callable[[Consumer], Subscription] | None,
    stop: threading.Event,
    exit_on_end: bool,
    server_key: str | None,
    client_secret_key: str | None,
    outcome: RunOutcome,
) -> ConsumerFailed | None:
    """One consumer instance, one subscription; the first callback error, if any."""
    failure: ConsumerFailed | None = None
    try:
        consumer = make()
    except Exception as e:
        failure = ConsumerFailed(_name_of(make), "construction", e)
        _report(failure, outcome)
        return failure
    sub: Subscriber | FanIn | None = None
    try:
        sub = subscribe(
            address,
            subscription(consumer) if subscription else consumer.subscription(),
            server_key=server_key,
            client_secret_key=client_secret_key,
        )
        # Everything made so far (torch, the consumer's model...) lives as long as the
        # process: moved out of the collector's sight, so the collections that a
        # stream of messages triggers stop rescanning it (py-spy: 21% and 44% of the
        # null consumer's samples at 2 MiB messages, under 2% once frozen).
        gc.freeze()
        rejected = 0
        while not stop.is_set():
            out = sub.recv(timeout=0.25)
            if sub.stats.rejected != rejected:
                rejected = sub.stats.rejected
                _call(consumer, "on_rejected", consumer.on_rejected, dict(sub.stats.rejected_by))
            if out is not None and _deliver(consumer, sub, out) and exit_on_end:
                log.info(
                    "the publisher ended the stream: stopping (--keep-waiting waits for "
                    "another to start at %s)",
                    address,
                )
                break
    except ConsumerFailed as e:
        failure = e
        _report(e, outcome)
    finally:
        try:
            _call(consumer, "close", consumer.close)
        except ConsumerFailed as e:
            _report(e, outcome)
            failure = failure or e
        finally:
            if sub is not None:
                sub.close()
                outcome.received += sub.stats.received
                outcome.missed += sub.stats.missed
                outcome.rejected += sub.stats.rejected
                outcome.publishers = per_publisher(sub)
    return failure


def _deliver(consumer: Consumer, sub: Subscriber | FanIn, out: Batch | Event) -> bool:
    """Hand one item to the consumer; True at the end of the stream."""
    if isinstance(out, Batch):
        _call(consumer, "on_batch", consumer.on_batch, out)
    elif out.kind == "welcome":
        _call(consumer, "on_welcome", consumer.on_welcome, out.body)
    elif out.kind == "heartbeat":
        caught_up = sub.caught_up(out.body)
        _call(consumer, "on_heartbeat", consumer.on_heartbeat, out.body, caught_up)
    elif out.kind == "mark":
        _call(consumer, "on_mark", consumer.on_mark, out.body)
    elif out.kind == "end":
        _call(consumer, "on_end", consumer.on_end)
        return True
    return False


def _call(consumer: Consumer, where: str, fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:
        raise ConsumerFailed(consumer.name or type(consumer).__name__, where, e) from e


def _name_of(make: Callable[[], Consumer]) -> str:
    """The consumer's name for a factory: a class, its bound from_args, or a partial of it."""
    target = getattr(make, "func", make)  # functools.partial
    owner = getattr(target, "__self__", target)  # a bound classmethod: its class
    return getattr(owner, "name", "") or getattr(owner, "__name__", "") or repr(make)


def _report(failure: ConsumerFailed, outcome: RunOutcome) -> None:
    outcome.errors += 1
    log.error("%s", failure, exc_info=failure.error)
