"""Subscriber side of monitors: read scores alone off the bus, per request.

``ScoreReader`` subscribes to the ``monitor`` hook only (no activation rows travel to
it) and cuts each message into one ``Scores`` per request: the monitor, the version
of its weights, the point, the positions and tokens scored and the values. Every
header field was checked at decode (``actbus.wire``); messages lost to a lossy policy
show as ``missed`` in ``stats``, never silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch, Event, Subscriber, SubscriberStats
from actbus.wire import MONITOR_HOOK, RequestEnd


@dataclass
class Scores:
    """One request's scores from one monitor at one layer, in one step."""

    monitor: str
    version: int
    """Version of the monitor's weights that produced every value here (from 1)."""
    layer: int
    hook: str
    step: int
    request_id: str
    sample_index: int
    positions: np.ndarray  # int64 [rows]
    token_ids: np.ndarray  # int64 [rows]
    values: np.ndarray  # float32 [rows, width]
    labels: tuple[int, ...] = ()
    """What each column scores (SAE latent indices); empty for a probe."""
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoreStep:
    """What one monitor message brought: its scores per request and the requests that
    ended since the previous step (their scores so far are all they will get)."""

    scores: list[Scores]
    ended: list[RequestEnd]


class ScoreReader:
    """Subscribe to a publisher's monitor scores (optionally some monitors and layers).

    ``subscription`` keys other than ``hooks`` (policy, window, ``match`` on request
    tags) are passed through; ``monitors`` keeps only the named monitors' scores."""

    def __init__(
        self,
        address: str,
        *,
        monitors: tuple[str, ...] | None = None,
        layers: tuple[int, ...] | None = None,
        welcome_timeout_s: float = 60.0,
        **subscription: Any,
    ) -> None:
        sub = Subscription(hooks=(MONITOR_HOOK,), layers=layers, **subscription)
        self.monitors = None if monitors is None else frozenset(monitors)
        self.sub = Subscriber(address, sub)
        self.info = self.sub.wait_welcome(welcome_timeout_s)

    @property
    def stats(self) -> SubscriberStats:
        return self.sub.stats

    def recv(self, timeout: float | None = None) -> ScoreStep | Event | None:
        """The next message's scores, a session event, or None if ``timeout`` passes."""
        out = self.sub.recv(timeout=timeout)
        if not isinstance(out, Batch):
            return out
        return ScoreStep(self.split(out), list(out.header.ended))

    def split(self, b: Batch) -> list[Scores]:
        return split_scores(b, self.monitors)

    def __iter__(self) -> Iterator[ScoreStep]:
        """Score steps until the publisher ends."""
        while True:
            out = self.recv(timeout=1.0)
            if isinstance(out, ScoreStep):
                yield out
            elif isinstance(out, Event) and out.kind == "end":
                return

    def close(self) -> None:
        self.sub.close()

    def __enter__(self) -> ScoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_scores(b: Batch, monitors: frozenset[str] | None = None) -> list[Scores]:
    """A monitor message cut into one ``Scores`` per request (none for a message of
    another hook, or of a monitor not in ``monitors``): what ``ScoreReader`` yields,
    for consumers that read the messages off their own subscriber (the dashboards)."""
    h, ri = b.header, b.header.rows
    mon = h.monitor
    if mon is None or (monitors is not None and mon.name not in monitors):
        return []
    values = b.tensor.numpy()
    out = []
    for i, rid in enumerate(ri.request_ids):
        lo, hi = int(ri.offsets[i]), int(ri.offsets[i + 1])
        out.append(
            Scores(
                monitor=mon.name,
                version=mon.version,
                layer=h.layer,
                hook=mon.hook,
                step=h.step,
                request_id=rid,
                sample_index=ri.request_sample_index(i),
                positions=np.asarray(ri.positions[lo:hi]),
                token_ids=np.asarray(ri.token_ids[lo:hi]),
                values=values[lo:hi].copy(),
                labels=mon.labels,
                tags=ri.request_tags(i),
            )
        )
    return out
