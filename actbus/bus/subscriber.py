"""The subscriber: a DEALER that asks for a subscription and grants credit.

Iterating a ``Subscriber`` yields ``Batch`` objects whose tensors are made
zero-copy over the received frames. Credit is a cumulative acknowledgement ("all
below seq N arrived or is known lost"), sent after half a window and at least
every 0.5 s while ``recv`` is called; it doubles as the subscriber's heartbeat.
If the publisher goes quiet (restart, not started yet), HELLO is sent again, so a
subscriber started before the publisher, or surviving a publisher restart, needs
no help from its user. Every message the publisher dropped for us shows up in
``stats.missed``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from actbus.bus.protocol import Subscription
from actbus.wire import (
    BYE,
    CREDIT,
    DATA,
    END,
    HEARTBEAT,
    HELLO,
    REJECT,
    WELCOME,
    Header,
    WireError,
    frame_to_tensor,
    pack_map,
    unpack_map,
    unpack_seq,
)

log = logging.getLogger("actbus.subscriber")


class SubscriptionRejected(RuntimeError):
    """The publisher refused the subscription; the message says why."""


@dataclass
class Batch:
    """One step of one (layer, hook): rows of activations and whose they are."""

    header: Header
    tensor: torch.Tensor  # [rows, hidden], read-only view over the received frame
    seq: int

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def layer(self) -> int:
        return self.header.layer

    @property
    def hook(self) -> str:
        return self.header.hook


@dataclass
class Event:
    """A control event surfaced to the consumer loop (heartbeat or end of stream)."""

    kind: str  # "heartbeat" | "end" | "welcome"
    body: dict[str, Any]


@dataclass
class SubscriberStats:
    received: int = 0
    bytes_received: int = 0
    missed: int = 0  # sequence-number gaps: messages the publisher dropped for us
    malformed: int = 0
    welcomes: int = 0
    last_step: int = -1
    publisher_step: int = -1  # the publisher's last published step, from heartbeats
    dropped_by_publisher: dict[str, int] = field(default_factory=dict)


class Subscriber:
    """Connects to a publisher and yields batches under one subscription."""

    def __init__(
        self,
        address: str,
        subscription: Subscription | None = None,
        *,
        silence_s: float = 3.0,
    ) -> None:
        self.address = address
        self.subscription = subscription or Subscription()
        self.silence_s = silence_s
        self.stats = SubscriberStats()
        self.welcome: dict[str, Any] | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # credit bounds what can arrive
        self._sock.connect(address)
        self._next_seq = 0  # lowest seq not yet received (or known lost)
        self._owed = 0  # messages received since the last acknowledgement
        self._owed_bytes = 0
        self._publisher_id: str | None = None
        self._last_heard = 0.0
        self._last_hello = 0.0
        self._last_credit = time.monotonic()
        self._hello()

    # ----------------------------------------------------------------- public API
    def recv(self, timeout: float | None = None) -> Batch | Event | None:
        """The next batch or control event, or None if ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._keepalive()
            wait = 250 if deadline is None else min(250, max(0, deadline - time.monotonic()) * 1e3)
            if self._sock.poll(int(wait), zmq.POLLIN):
                out = self._handle(self._sock.recv_multipart(copy=False))
                if out is not None:
                    return out
            elif deadline is not None and time.monotonic() >= deadline:
                return None

    def caught_up(self, beat: dict[str, Any]) -> bool:
        """True when a heartbeat shows nothing sent, pending or queued for us."""
        return (
            int(beat.get("seq", 0)) <= self._next_seq
            and not beat.get("pending")
            and not beat.get("queued")
        )

    def wait_welcome(self, timeout: float) -> dict[str, Any]:
        """Block until the publisher accepted the subscription (or raise)."""
        deadline = time.monotonic() + timeout
        while self.welcome is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no publisher answered at {self.address} within {timeout}s")
            self.recv(timeout=left)
        return self.welcome

    def __iter__(self) -> Iterator[Batch]:
        """Batches until the publisher says it ended."""
        while True:
            out = self.recv()
            if isinstance(out, Batch):
                yield out
            elif isinstance(out, Event) and out.kind == "end":
                return

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([BYE, pack_map({})], zmq.NOBLOCK)
        self._sock.close(linger=100)
        self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _send(self, frames: list[bytes]) -> None:
        """Control messages never block: with no publisher they would pile up forever."""
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(frames, zmq.NOBLOCK)

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        self._send([HELLO, pack_map(self.subscription.to_wire())])

    def _silent(self, now: float) -> bool:
        if self.welcome is None:
            return True
        limit = max(self.silence_s, 8 * float(self.welcome.get("heartbeat_s", 0.5)))
        # Messages already waiting mean the publisher is alive, however long we were away.
        return now - self._last_heard > limit and not self._sock.poll(0)

    def _keepalive(self) -> None:
        now = time.monotonic()
        if self._silent(now) and now - self._last_hello > 1.0:
            if self.welcome is not None:
                log.warning("publisher at %s went quiet; subscribing again", self.address)
                self.welcome = None
            self._hello()
        elif self.welcome is not None and now - self._last_credit > 0.5:
            self._grant()

    def _grant(self) -> None:
        self._send([CREDIT, pack_map({"acked": self._next_seq})])
        self._owed = 0
        self._owed_bytes = 0
        self._last_credit = time.monotonic()

    def _handle(self, frames: list[zmq.Frame]) -> Batch | Event | None:
        self._last_heard = time.monotonic()
        tag = frames[0].bytes if frames else b""
        try:
            if tag == DATA:
                self._owed += 1
                self._owed_bytes += len(frames[-1].buffer)
                try:
                    if len(frames) != 4:
                        raise WireError(f"data message has {len(frames)} frames, expected 4")
                    return self._data(frames)
                finally:  # acknowledged even when unreadable, so credit never leaks
                    sub = self.subscription
                    if self._owed >= max(1, sub.window // 2) or (
                        self._owed_bytes >= sub.window_bytes // 2
                    ):
                        self._grant()
            if len(frames) != 2:
                raise WireError(f"unexpected message shape ({len(frames)} frames)")
            body = unpack_map(frames[1].buffer)
        except WireError as e:
            self.stats.malformed += 1
            log.warning("malformed message from publisher: %s", e)
            return None
        if tag == WELCOME:
            self.welcome = body
            self.stats.welcomes += 1
            next_seq = int(body.get("next_seq", 0))
            if body.get("publisher_id") != self._publisher_id:  # a new stream
                self._publisher_id = body.get("publisher_id")
                self._next_seq = next_seq
            else:
                self._skip_to(next_seq)
            return Event("welcome", body)
        if tag == HEARTBEAT:
            self.stats.publisher_step = int(body.get("step", -1))
            self.stats.dropped_by_publisher = dict(body.get("dropped") or {})
            if not body.get("pending"):
                # Nothing waits for us at the publisher, and everything it sent before
                # this heartbeat has arrived: seqs below its counter that we lack were dropped.
                self._skip_to(int(body.get("seq", 0)))
            return Event("heartbeat", body)
        if tag == END:
            self.welcome = None
            return Event("end", body)
        if tag == REJECT:
            reason = str(body.get("reason", ""))
            if "unknown subscriber" in reason:
                self._hello()
                return None
            raise SubscriptionRejected(f"publisher at {self.address} refused: {reason}")
        self.stats.malformed += 1
        return None

    def _skip_to(self, seq: int) -> None:
        if seq > self._next_seq:
            self.stats.missed += seq - self._next_seq
            self._next_seq = seq
            self._grant()

    def _data(self, frames: list[zmq.Frame]) -> Batch:
        seq = unpack_seq(frames[1].buffer)
        if seq > self._next_seq:
            self.stats.missed += seq - self._next_seq
        self._next_seq = max(self._next_seq, seq + 1)
        header = Header.decode(frames[2].buffer)
        tensor = frame_to_tensor(frames[3].buffer, header)
        self.stats.received += 1
        self.stats.bytes_received += header.nbytes
        self.stats.last_step = max(self.stats.last_step, header.step)
        return Batch(header=header, tensor=tensor, seq=seq)
