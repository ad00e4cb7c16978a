"""Consumer plugins: subscribers that do something with the stream.

A consumer subclasses ``Consumer`` and is registered under the
``actbus.consumers`` entry-point group; ``actbus run NAME`` finds it there, lets
it add its own command-line flags, subscribes with its policy and feeds it.
"""

from __future__ import annotations

import argparse
import logging
import threading
from abc import ABC, abstractmethod
from importlib.metadata import entry_points
from typing import Any, ClassVar

from actbus.bus import Batch, Event, Subscriber, Subscription
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
        tags: dict[str, Any] | None = None,
        group: str = "",
    ) -> Subscription:
        """What to ask the publisher for; override to filter layers or hooks.

        ``policy`` is a policy string (``sample:N``, ``spill:MB:FALLBACK``...);
        ``tags`` keeps only matching requests; ``group`` shares the stream with the
        group's other members (load-balanced) instead of receiving all of it.
        """
        return Subscription(
            **parse_policy(policy or self.default_policy),
            window=window,
            window_bytes=window_bytes,
            tags=tags,
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

    def on_end(self) -> None:
        """The publisher shut down (the engine stopped)."""

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


def run(
    consumer: Consumer,
    address: str,
    *,
    subscription: Subscription | None = None,
    stop: threading.Event | None = None,
    exit_on_end: bool = False,
) -> Subscriber:
    """Feed ``consumer`` from the publisher at ``address`` until stopped.

    Returns the (closed) subscriber so callers can read its counters.
    """
    stop = stop or threading.Event()
    sub = Subscriber(address, subscription or consumer.subscription())
    try:
        while not stop.is_set():
            out = sub.recv(timeout=0.25)
            if isinstance(out, Batch):
                consumer.on_batch(out)
            elif isinstance(out, Event):
                if out.kind == "welcome":
                    consumer.on_welcome(out.body)
                elif out.kind == "heartbeat":
                    consumer.on_heartbeat(out.body, caught_up=sub.caught_up(out.body))
                elif out.kind == "end":
                    consumer.on_end()
                    if exit_on_end:
                        break
    finally:
        try:
            consumer.close()
        finally:
            sub.close()
    return sub
