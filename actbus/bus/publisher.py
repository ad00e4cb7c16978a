"""The publisher: one ROUTER socket, per-subscriber credit, queues and policies.

The engine thread hands each captured message to ``publish``, which only queues it
(within a byte budget) and returns; a background thread owns the socket and does
all sending. What happens when a subscriber has no credit is that subscriber's
policy: ``block`` holds back the shared queue (the engine waits once the budget is
spent), ``drop_newest`` counts and drops.

Sequence numbers are given per subscriber when a message is routed to it, so a
dropped message leaves a gap the subscriber sees. Credit is cumulative: a
subscriber acknowledges "everything below seq N", and the publisher derives what
is in flight from that, so a lost acknowledgement or message never leaks credit.

Dead subscribers are found two ways: ``ROUTER_MANDATORY`` makes a send to a peer
whose connection closed fail at once (heartbeats go out every ``heartbeat_s``, so
a killed process is noticed within that), and a subscriber silent for
``subscriber_timeout_s`` is dropped. Either way it is no longer waited for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter, deque
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
    SCHEMA_VERSION,
    WELCOME,
    Header,
    WireError,
    pack_map,
    pack_seq,
    tensor_to_frame,
    unpack_map,
)

log = logging.getLogger("actbus.publisher")

# How many messages a subscriber may have waiting beyond its credit before its
# policy applies (block: hold the shared queue; drop_newest: drop).
PENDING_LIMIT = 8


@dataclass
class _Item:
    header: Header
    tensor: torch.Tensor  # keeps the payload's memory alive until sent
    nbytes: int
    ready: Any = None  # an event to wait on before the tensor and row index are readable
    header_bytes: bytes = b""
    payload: memoryview | None = None

    def materialize(self) -> None:
        """Wait for the device copy, then encode: done on the publisher thread."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        self.header_bytes = self.header.encode()
        self.payload = tensor_to_frame(self.tensor)


@dataclass
class _Sub:
    ident: bytes
    sub: Subscription
    last_seen: float
    pending: deque[tuple[int, _Item]] = field(default_factory=deque)
    next_seq: int = 0  # the seq the next routed message gets
    inflight: deque[tuple[int, int]] = field(default_factory=deque)  # (seq, nbytes) unacked
    inflight_bytes: int = 0
    sent: int = 0
    bytes_sent: int = 0
    sampled_out: int = 0  # steps a ``sample`` subscriber did not ask for
    dropped: Counter[str] = field(default_factory=Counter)

    def may_send(self, nbytes: int) -> bool:
        """Within both credits; an oversized message goes alone when nothing is in flight."""
        if not self.inflight:
            return True
        return (
            len(self.inflight) < self.sub.window
            and self.inflight_bytes + nbytes <= self.sub.window_bytes
        )

    def ack(self, acked: int) -> None:
        while self.inflight and self.inflight[0][0] < acked:
            self.inflight_bytes -= self.inflight.popleft()[1]


class Publisher:
    """Publishes activation messages to any number of subscribers."""

    def __init__(
        self,
        address: str,
        *,
        info: dict[str, Any],
        queue_bytes: int = 1 << 30,
        heartbeat_s: float = 0.5,
        subscriber_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.id = uuid.uuid4().hex
        self._info = {**info, "publisher_id": self.id, "heartbeat_s": heartbeat_s}
        self._queue_budget = queue_bytes
        self._heartbeat_s = heartbeat_s
        self._timeout_s = subscriber_timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # credit bounds what is in flight
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"actbus.publish={address!r}: cannot bind: {e}") from e
        self._queue: deque[_Item] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._subs: dict[bytes, _Sub] = {}
        self._closing = False
        self._closed = False
        self._stopped = threading.Event()
        self._counters: Counter[str] = Counter()
        self.last_step = -1
        self.stall_s = 0.0  # time the engine spent waiting for queue space
        self._thread = threading.Thread(target=self._run, name="actbus-publisher", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- engine side
    def publish(self, header: Header, tensor: torch.Tensor, *, ready: Any = None) -> None:
        """Queue one message; waits (lossless) only while the byte budget is spent.

        ``ready``, if given, is an event (e.g. ``torch.cuda.Event``) that must complete
        before ``tensor`` and the header's row index hold their data.
        """
        item = _Item(header, tensor.contiguous(), header.nbytes, ready)
        with self._cond:
            t0 = None
            while (
                self._queue
                and self._queued_bytes + item.nbytes > self._queue_budget
                and not self._closing
            ):
                t0 = t0 or time.monotonic()
                self._cond.wait(timeout=0.5)
            if t0 is not None:
                self.stall_s += time.monotonic() - t0
            if self._closing:
                self._counters["dropped_after_close"] += 1
                return
            was_empty = not self._queue
            self._queue.append(item)
            self._queued_bytes += item.nbytes
            if was_empty:
                self._wake()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            subs: dict[str, dict[str, Any]] = {}
            for s in list(self._subs.values()):
                key = s.sub.name or s.ident.hex()
                if key in subs:  # names need not be unique
                    key = f"{key}#{s.ident.hex()[:8]}"
                subs[key] = {
                    "policy": s.sub.policy,
                    "sent": s.sent,
                    "bytes_sent": s.bytes_sent,
                    "dropped": dict(s.dropped),
                    "sampled_out": s.sampled_out,
                    "pending": len(s.pending),
                    "inflight": len(s.inflight),
                    "inflight_bytes": s.inflight_bytes,
                }
            return {
                "published": 0,
                "unrouted": 0,
                **dict(self._counters),
                "last_step": self.last_step,
                "queued": len(self._queue),
                "queued_bytes": self._queued_bytes,
                "stall_s": round(self.stall_s, 3),
                "subscribers": subs,
            }

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), tell subscribers, stop. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._busy() and not self._stopped.is_set():
            time.sleep(0.01)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._wake()
        self._thread.join(timeout=max(0.5, deadline - time.monotonic() + 1.0))

    # ------------------------------------------------------------ publisher thread
    def _busy(self) -> bool:
        with self._cond:
            return bool(self._queue) or any(s.pending for s in self._subs.values())

    def _wake(self) -> None:
        """Called with ``_cond`` held, so the pipe is never closed underneath."""
        if not self._stopped.is_set():
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                with self._cond:
                    closing = self._closing
                    more = bool(self._queue) and self._can_take()
                if closing:
                    self._broadcast(END, {"last_step": self.last_step})
                    break
                # Work left that needs no event: do not sleep (no lost wake-ups).
                wait_ms = 0 if more else max(0, int((next_beat - time.monotonic()) * 1000))
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self._sock in events:
                    self._read_control()
                self._take_items()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self._heartbeat_s
        except Exception:  # the engine must never die of the bus
            log.exception("actbus publisher thread failed; capture data is no longer sent")
        finally:
            self._sock.close(linger=0)
            self._ctx.term()
            with self._cond:
                self._stopped.set()
                self._closing = True
                self._queue.clear()
                self._cond.notify_all()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _read_control(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                self._counters["malformed_control"] += 1
                continue
            ident, tag, body = frames
            try:
                msg = unpack_map(body)
            except WireError:
                self._counters["malformed_control"] += 1
                continue
            now = time.monotonic()
            sub = self._subs.get(ident)
            if tag == HELLO:
                self._hello(ident, msg, now)
            elif tag == CREDIT:
                acked = msg.get("acked")
                if sub is None:
                    self._send_control(ident, REJECT, {"reason": "unknown subscriber; send HELLO"})
                elif isinstance(acked, int) and not isinstance(acked, bool) and acked >= 0:
                    sub.ack(acked)
                    sub.last_seen = now
                    self._flush(sub)
                else:
                    self._counters["malformed_control"] += 1
            elif tag == BYE:
                if sub is not None:
                    self._remove(sub, "left")
            else:
                self._counters["malformed_control"] += 1

    def _hello(self, ident: bytes, msg: dict[str, Any], now: float) -> None:
        try:
            sub = Subscription.from_wire(msg)
        except WireError as e:
            self._counters["rejected"] += 1
            self._send_control(ident, REJECT, {"reason": str(e)})
            return
        with self._cond:
            s = self._subs.get(ident)
            if s is None:
                s = self._subs[ident] = _Sub(ident=ident, sub=sub, last_seen=now)
                log.info("subscriber %s joined (policy=%s)", sub.name or ident.hex(), sub.policy)
            else:
                # The same subscriber again (it thought we went quiet): keep its
                # queue and numbering, so nothing is lost or renumbered.
                self._counters["resubscribed"] += 1
                s.sub, s.last_seen = sub, now
                s.inflight.clear()
                s.inflight_bytes = 0
        next_seq = s.pending[0][0] if s.pending else s.next_seq
        self._send_control(
            ident,
            WELCOME,
            {**self._info, "schema": SCHEMA_VERSION, "step": self.last_step, "next_seq": next_seq},
        )
        self._flush(s)

    def _can_take(self) -> bool:
        return all(
            len(s.pending) < PENDING_LIMIT for s in self._subs.values() if s.sub.policy == "block"
        )

    def _take_items(self) -> None:
        while True:
            with self._cond:
                if not self._queue or not self._can_take():
                    return
                item = self._queue.popleft()
                self._queued_bytes -= item.nbytes
                self._cond.notify_all()
            try:
                item.materialize()
            except Exception:  # one bad message must not end the bus
                log.exception("actbus: could not encode a message; dropped")
                self._counters["encode_errors"] += 1
                continue
            h = item.header
            routed = False
            for s in list(self._subs.values()):
                if not s.sub.wants(h.layer, h.hook):
                    continue
                routed = True
                policy = s.sub.policy
                if policy == "sample" and h.step % s.sub.sample_every:
                    s.sampled_out += 1  # not wanted: neither a drop nor a gap
                    continue
                seq = s.next_seq
                s.next_seq += 1
                if len(s.pending) >= PENDING_LIMIT and not s.may_send(item.nbytes):
                    if policy in ("drop_newest", "sample"):
                        s.dropped["queue_full"] += 1  # its seq is skipped: a visible gap
                        continue
                    if policy == "drop_oldest":
                        s.pending.popleft()  # the oldest unsent one leaves a gap instead
                        s.dropped["evicted"] += 1
                s.pending.append((seq, item))
                self._flush(s)
            if not routed:
                self._counters["unrouted"] += 1
            # Counted once routed to every subscriber, so stats never show a message as
            # published that a subscriber's counters do not yet include.
            self.last_step = max(self.last_step, h.step)
            self._counters["published"] += 1

    def _flush(self, s: _Sub) -> None:
        """Send what ``s``'s credit allows."""
        while s.pending and s.may_send(s.pending[0][1].nbytes):
            seq, item = s.pending[0]
            try:
                self._sock.send_multipart(
                    [s.ident, DATA, pack_seq(seq), item.header_bytes, item.payload], copy=False
                )
            except zmq.ZMQError as e:
                self._lost(s, e)
                return
            s.pending.popleft()
            s.inflight.append((seq, item.nbytes))
            s.inflight_bytes += item.nbytes
            s.sent += 1
            s.bytes_sent += item.nbytes

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for s in list(self._subs.values()):
            if now - s.last_seen > self._timeout_s:
                log.warning("subscriber %s timed out; no longer waited for", s.sub.name)
                self._remove(s, "timeout")
                continue
            beat = {
                "step": self.last_step,
                "seq": s.next_seq,
                "pending": len(s.pending),
                "queued": len(self._queue),
                "sent": s.sent,
                "dropped": dict(s.dropped),
            }
            if not self._send_control(s.ident, HEARTBEAT, beat):
                self._remove(s, "disconnected")

    def _broadcast(self, tag: bytes, body: dict[str, Any]) -> None:
        for s in list(self._subs.values()):
            self._send_control(s.ident, tag, body)

    def _send_control(self, ident: bytes, tag: bytes, body: dict[str, Any]) -> bool:
        try:
            self._sock.send_multipart([ident, tag, pack_map(body)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def _lost(self, s: _Sub, err: zmq.ZMQError) -> None:
        if err.errno == zmq.EHOSTUNREACH:
            log.warning("subscriber %s disconnected; no longer waited for", s.sub.name)
            self._remove(s, "disconnected")
        else:
            log.error("actbus: send to %s failed (%s); dropping it", s.sub.name, err)
            self._remove(s, "send_error")

    def _remove(self, s: _Sub, reason: str) -> None:
        if s.pending:
            s.dropped[reason] += len(s.pending)
            s.pending.clear()
        with self._cond:
            self._subs.pop(s.ident, None)
        self._counters[f"subscribers_{reason}"] += 1
