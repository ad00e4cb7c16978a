"""The publisher: one ROUTER socket, per-subscriber credit, queues and policies.

The engine thread hands each captured message to ``publish``, which only queues it
(within a byte budget) and returns; a background thread owns the socket and does
all sending. What happens when a subscriber has no credit is that subscriber's
policy: ``block`` holds back the shared queue (the engine waits once the budget is
spent), ``drop_newest``/``sample`` drop the new message, ``drop_oldest`` evicts the
oldest waiting one, ``spill`` writes it to local disk (``spill.py``) and replays it
in order later, up to a cap after which its fallback applies.

Routing: a subscriber gets the messages of the layers and hooks it asked for, cut
down to the requests its tag filter matches (a copy, made once per distinct
filter; unfiltered subscribers get the captured buffer itself). Subscribers that
name the same ``group`` share one copy of the stream: each message goes to exactly
one member, the least loaded one with credit.

Admission (engine side, before any copy): ``admit`` tells the capture worker
whether a tap's rows are wanted at all, and whether every subscriber that wants
them would drop them anyway (each is lossy, and its queue is full, or this is not
one of its sampled steps, or the shared queue's byte budget is spent). Then the
worker skips the device gather and host copy and calls ``drop``: the message is
routed as a counted drop (reason ``source``), so it still leaves a gap in each
subscriber's sequence. A lossless subscriber always gets the copy; only it can
make the engine wait.

Sequence numbers are given per subscriber when a message is routed to it, so a
dropped message leaves a gap the subscriber sees. Credit is cumulative: a
subscriber acknowledges "everything below seq N", and the publisher derives what
is in flight from that, so a lost acknowledgement or message never leaks credit.

Dead subscribers are found two ways: ``ROUTER_MANDATORY`` makes a send to a peer
whose connection closed fail at once (heartbeats go out every ``heartbeat_s``, so
a killed process is noticed within that), and a subscriber silent for
``subscriber_timeout_s`` is dropped. A subscriber keeps itself alive while its
consumer is busy through a keepalive socket of its own (``KEEPALIVE`` names the
subscriber it speaks for). Either way a dead one is no longer waited for.

Every control message that breaks the schema is counted in ``rejected`` and
dropped; frames above ``MAX_CONTROL_BYTES`` are refused by libzmq before they are
allocated (the sender's connection is closed; counted in ``connections_closed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from actbus.bus.accounting import LatencyWindow, SubCounters
from actbus.bus.protocol import Subscription
from actbus.bus.security import ServerAuth
from actbus.bus.spill import SpillLog
from actbus.wire import (
    BYE,
    CREDIT,
    DATA,
    END,
    HEARTBEAT,
    HELLO,
    KEEPALIVE,
    MARK,
    REJECT,
    SCHEMA_VERSION,
    STATS,
    WELCOME,
    Header,
    RowIndex,
    WireError,
    pack_map,
    pack_seq,
    tensor_to_frame,
    unpack_map,
)

log = logging.getLogger("actbus.publisher")

# How many messages a subscriber may have waiting beyond its credit before its
# policy applies (block: hold the shared queue; drop_newest: drop; spill: to disk).
PENDING_LIMIT = 8
# How long the socket may still deliver END (and what was sent) once closed.
CLOSE_LINGER_MS = 1000
_SNDMORE = int(zmq.SNDMORE)
# Largest control frame accepted; control messages are small maps.
MAX_CONTROL_BYTES = 256 << 10
# Control messages handled per loop turn, so a flood cannot starve sending.
CONTROL_BATCH = 256
DEPARTED_KEPT = 32
# Steps a sample:R/s subscriber remembers taking: routing may lag the engine by this many.
RATE_STEPS_KEPT = 4096
_NO_ROWS = torch.empty(0, dtype=torch.uint8)


class Admission(Enum):
    """What the engine should do with one tap's rows this step (see ``Publisher.admit``)."""

    SEND = "send"  # copy the rows and ``publish`` them
    DROP = "drop"  # every subscriber that wants them would drop them: call ``drop``
    NONE = "none"  # no subscriber wants them: nothing to do


@dataclass
class _Item:
    header: Header
    tensor: torch.Tensor | None  # keeps the payload alive until sent; None: dropped at source
    nbytes: int
    ready: Any = None  # an event to wait on before the tensor and row index are readable
    t_published: float = 0.0
    header_bytes: bytes = b""
    payload: memoryview | None = None
    root: _Item | None = None  # a filtered copy: the message it was cut from
    sent_once: bool = False
    variants: dict[str, _Item | None] | None = None  # per tag filter, made once
    counted: tuple[_Sub, ...] = ()  # subscribers whose queued_in counts it

    def materialize(self) -> None:
        """Wait for the device copy, then encode: done on the publisher thread."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        if self.tensor is None:  # dropped at the source: routed as a drop, never sent
            self.payload = memoryview(b"")
            return
        self.header_bytes = self.header.encode()
        self.payload = tensor_to_frame(self.tensor)

    @property
    def wire_bytes(self) -> int:
        return len(self.header_bytes) + self.nbytes


class _StepRate:
    """Which steps a ``sample:R/s`` subscriber takes: the first step seen at least
    1/R s after the last one taken. Decided once per step, by whichever thread meets
    the step first (the engine's ``admit``, or routing for a message published
    without it), so that copying and routing agree on it."""

    def __init__(self, per_s: float) -> None:
        self.period = 1.0 / per_s
        self._lock = threading.Lock()
        self._decided = -1  # the newest step decided
        self._due = 0.0
        self._taken: set[int] = set()
        self._order: deque[int] = deque()  # taken steps, oldest first (to forget them)

    def takes(self, step: int) -> bool:
        if step > self._decided:
            with self._lock:
                if step > self._decided:
                    now = time.monotonic()
                    if now >= self._due:
                        self._due = now + self.period
                        self._taken.add(step)
                        self._order.append(step)
                        if len(self._order) > RATE_STEPS_KEPT:
                            self._taken.discard(self._order.popleft())
                    self._decided = step  # last: a reader that sees it finds the verdict
        return step in self._taken


@dataclass
class _Sub:
    ident: bytes
    sub: Subscription
    last_seen: float
    acked_step: int  # the step of the newest acknowledged message (lag is measured from it)
    pending: deque[tuple[int, _Item]] = field(default_factory=deque)
    next_seq: int = 0  # the seq the next routed message gets
    inflight: deque[tuple[int, int, int]] = field(default_factory=deque)  # seq, nbytes, step
    inflight_bytes: int = 0
    spill: SpillLog | None = None
    c: SubCounters = field(default_factory=SubCounters)
    # Messages published for it and not yet routed (each side written by one thread).
    queued_in: int = 0  # by publishers, under the queue lock
    queued_out: int = 0  # by the publisher thread
    sampled_at_source: int = 0  # by the engine thread: steps skipped in admit
    rate: _StepRate | None = None  # sample:R/s

    def __post_init__(self) -> None:
        if self.sub.policy == "sample" and self.sub.sample_per_s > 0:
            self.rate = _StepRate(self.sub.sample_per_s)

    def skips(self, step: int) -> bool:
        """A sampler's step it does not take."""
        if self.sub.policy != "sample":
            return False
        if self.rate is not None:
            return not self.rate.takes(step)
        return step % self.sub.sample_every != 0

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
            _, nbytes, step = self.inflight.popleft()
            self.inflight_bytes -= nbytes
            self.acked_step = max(self.acked_step, step)

    @property
    def spilled_now(self) -> int:
        return len(self.spill) if self.spill is not None else 0

    @property
    def queued(self) -> int:
        """Routed to it, not yet sent: in memory or on disk."""
        return len(self.pending) + self.spilled_now

    @property
    def spill_cap(self) -> int:
        return int(self.sub.spill_mb * (1 << 20))

    def overflowing(self, nbytes: int) -> bool:
        """A new message cannot join ``pending``: spill is in use (order) or no room."""
        return self.spilled_now > 0 or (
            len(self.pending) >= PENDING_LIMIT and not self.may_send(nbytes)
        )

    @property
    def lossless(self) -> bool:
        return self.sub.policy == "block" or (
            self.sub.policy == "spill" and self.sub.spill_fallback == "block"
        )

    def blocks(self, item: _Item) -> bool:
        """True when taking ``item`` now would break this subscriber's lossless promise."""
        if self.sub.policy == "block":
            return len(self.pending) >= PENDING_LIMIT
        if self.sub.policy == "spill" and self.sub.spill_fallback == "block":
            held = self.spill.nbytes if self.spill is not None else 0
            return self.overflowing(item.nbytes) and held + item.wire_bytes > self.spill_cap
        return False

    def free(self, step: int, nbytes: int) -> int:
        """How many more messages of ``step`` this subscriber would take now without
        dropping one, before what is queued for it ahead (``ahead``): free pending
        slots and credit. Effectively unbounded for policies that never drop the
        newest message.

        Read from the engine thread without a lock: a stale answer only moves a
        drop from here to the publisher thread or back; both are counted.
        """
        p = self.sub
        if self.skips(step):
            return 0
        if p.policy not in ("drop_newest", "sample"):
            return 1 << 30
        if self.spilled_now:
            return 0
        credit = max(0, p.window - len(self.inflight))
        if nbytes:
            credit = min(credit, max(0, p.window_bytes - self.inflight_bytes) // nbytes)
        return max(0, PENDING_LIMIT - len(self.pending)) + credit

    @property
    def ahead(self) -> int:
        """Messages published for it (or its group) and not routed yet."""
        return self.queued_in - self.queued_out

    def wants(self, layer: int, hook: str, for_return: bool) -> bool:
        """Whether a message of this tap can hold anything for it; the front end's
        return subscriber only wants messages with returned rows or request ends."""
        return self.sub.wants(layer, hook) and (for_return or not self.sub.returned_only)

    def policy_text(self) -> str:
        p = self.sub
        if p.policy == "sample":
            return f"sample:{p.sample_per_s:g}/s" if p.sample_per_s else f"sample:{p.sample_every}"
        if p.policy == "spill":
            return f"spill:{p.spill_mb:g}:{p.spill_fallback}"
        return p.policy


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
        spill_dir: str | Path | None = None,
        server_secret_key: str | None = None,
        authorized_keys: str | None = None,
        insecure_allow_any_interface: bool = False,
    ) -> None:
        self.address = address
        self.id = uuid.uuid4().hex
        self._info = {**info, "publisher_id": self.id, "heartbeat_s": heartbeat_s}
        self._queue_budget = queue_bytes
        self._heartbeat_s = heartbeat_s
        self._timeout_s = subscriber_timeout_s
        self._spill_parent = spill_dir  # None: the system temp dir
        self._spill_root: Path | None = None
        # Refuses a non-loopback bind without CURVE keys (ConfigError), before any socket.
        self._auth = ServerAuth(
            address,
            server_secret_key=server_secret_key,
            authorized_keys=authorized_keys,
            insecure_allow_any_interface=insecure_allow_any_interface,
        )
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # credit bounds what is in flight
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        try:
            self._auth.apply(self._ctx, self._sock)  # CURVE + authenticator, before bind
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._auth.close()
            self._ctx.term()
            raise OSError(f"actbus.publish={address!r}: cannot bind: {e}") from e
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._queue: deque[_Item] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._subs: dict[bytes, _Sub] = {}
        self._sub_list: tuple[_Sub, ...] = ()  # a snapshot for the engine thread (admit)
        self._engine_counts: Counter[str] = Counter()  # written by the engine thread only
        self._departed: deque[dict[str, Any]] = deque(maxlen=DEPARTED_KEPT)
        self._group_departed: dict[str, Counter[str]] = {}
        self._latency = LatencyWindow()
        self._closing = False
        self._closed = False
        self._stopped = threading.Event()
        self._counters: Counter[str] = Counter()
        self._routed_step = -1  # by the publisher thread
        self._skipped_step = -1  # by the engine thread: a step every sampler skipped
        self.stall_s = 0.0  # time the engine spent waiting for queue space
        self._capture_s = 0.0  # engine thread: time spent in actbus (count_step)
        self._thread_cpu_s = 0.0  # the publisher thread's CPU time, as of its last turn
        self._thread = threading.Thread(target=self._run, name="actbus-publisher", daemon=True)
        self._thread.start()

    @property
    def last_step(self) -> int:
        """The newest step routed, or skipped at the source by every sampler."""
        return max(self._routed_step, self._skipped_step)

    # ---------------------------------------------------------------- engine side
    def count_step(self, tokens: int, capture_s: float = 0.0) -> None:
        """The engine ran a step of ``tokens`` tokens (prompt and generated), captured
        or not, and its own thread spent ``capture_s`` seconds of it in actbus (rows
        planned, copies launched, messages queued): ``tokens`` and ``capture_s`` in the
        stats, so dashboards show tokens/s as counted, not estimated from what they
        sample, and what capture costs the engine is counted, not guessed. Engine
        thread only."""
        self._engine_counts["tokens"] += tokens
        self._capture_s += capture_s

    def admit(self, step: int, taps: list[tuple[int, str, int, bool]]) -> list[Admission]:
        """Which taps of a step are worth copying: ``taps`` are ``(layer, hook,
        nbytes, for_return)``, in the order the engine will publish them;
        ``for_return`` says the message has rows of a request that asked for them
        back, or request ends (only then does the front end's subscriber want it).

        Called by the engine before it gathers and copies anything, so that data
        nobody would receive costs nothing: ``NONE`` for a tap no subscriber wants,
        ``DROP`` when every subscriber that wants it is lossy and would drop it
        (no room left in its queue and credit once the messages ahead of it are
        routed, a step it does not sample, or the shared queue's byte budget
        spent), else ``SEND``. Room is spent tap by tap, so a step of many taps
        copies only as many as fit. Never waits.
        """
        if self._closing:
            return [Admission.NONE] * len(taps)
        subs = self._sub_list
        room: dict[str, int] = {}  # per lossy subscriber or group: messages that still fit
        budget = self._queue_budget - self._queued_bytes
        first = not self._queue  # one message always fits an empty queue
        out = []
        for layer, hook, nbytes, for_return in taps:
            wanted = [s for s in subs if s.wants(layer, hook, for_return)]
            if not wanted:
                self._engine_counts["not_wanted"] += 1
                out.append(Admission.NONE)
                continue
            if all(s.skips(step) for s in wanted):
                # Only samplers want it, and none samples this step: nothing to copy,
                # queue or route (a sampled-out step is neither a drop nor a gap).
                for s in wanted:
                    s.sampled_at_source += 1
                self._engine_counts["sampled_out"] += 1
                self._skipped_step = max(self._skipped_step, step)
                out.append(Admission.NONE)
                continue
            lossless = any(s.lossless for s in wanted)
            if not lossless and nbytes > budget and not first:
                out.append(Admission.DROP)
                continue
            units: dict[str, list[_Sub]] = {}
            for s in wanted:
                units.setdefault(f"g:{s.sub.group}" if s.sub.group else s.ident.hex(), []).append(s)
            takers = []
            for key, members in units.items():
                if key not in room:
                    # A group's backlog is counted on each member: subtract it once.
                    free = sum(max(0, m.free(step, nbytes)) for m in members)
                    room[key] = free - members[0].ahead
                if room[key] > 0:
                    takers.append(key)
            if not (lossless or takers):
                out.append(Admission.DROP)
                continue
            for key in takers:
                room[key] -= 1
            budget -= nbytes
            first = False
            out.append(Admission.SEND)
        return out

    def drop(self, header: Header) -> None:
        """Record a message that ``admit`` said to drop: each lossy subscriber of its
        tap counts a drop (reason ``source``) and sees a gap. Request ends it carries
        still go out, in a message with no rows."""
        item = _Item(header, None, 0, None, time.monotonic())
        ends = None
        if header.shape[0] == 0:  # no rows to lose: only its request ends matter
            item = None
        if header.ended:
            end_header = dataclasses.replace(
                header, shape=(0, *header.shape[1:]), rows=RowIndex.empty()
            )
            ends = _Item(end_header, _NO_ROWS, 0, None, time.monotonic())
        with self._cond:
            if self._closing:
                return
            was_empty = not self._queue
            if item is not None:
                self._queue.append(item)
            if ends is not None:
                self._queue.append(ends)
            if was_empty and self._queue:
                self._wake()

    def publish(self, header: Header, tensor: torch.Tensor, *, ready: Any = None) -> None:
        """Queue one message; waits (lossless) only while the byte budget is spent.

        ``ready``, if given, is an event (e.g. ``torch.cuda.Event``) that must complete
        before ``tensor`` and the header's row index hold their data.
        """
        item = _Item(header, tensor.contiguous(), header.nbytes, ready, time.monotonic())
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
            h = header
            item.counted = tuple(s for s in self._sub_list if s.sub.wants(h.layer, h.hook))
            for s in item.counted:
                s.queued_in += 1
            self._queue.append(item)
            self._queued_bytes += item.nbytes
            if was_empty:
                self._wake()

    def stats(self) -> dict[str, Any]:
        """Every counter: global, per subscriber, per group, and recent departures."""
        with self._cond:
            subs: dict[str, dict[str, Any]] = {}
            for s in list(self._subs.values()):
                key = s.sub.name or s.ident.hex()
                if key in subs:  # names need not be unique
                    key = f"{key}#{s.ident.hex()[:8]}"
                subs[key] = self._sub_stats(s)
            groups: dict[str, dict[str, Any]] = {}
            for name, gone in self._group_departed.items():
                groups[name] = {"members": 0, **gone}
            for s in self._subs.values():
                if s.sub.group:
                    g = groups.setdefault(s.sub.group, {"members": 0})
                    g["members"] += 1
                    for k in ("routed", "sent", "replayed"):
                        g[k] = g.get(k, 0) + getattr(s.c, k)
                    g["dropped"] = g.get("dropped", 0) + sum(s.c.dropped.values())
            return {
                "published": 0,
                "tokens": 0,
                "unrouted": 0,
                "rejected": 0,
                "source_drops": 0,
                **dict(self._counters),
                **dict(self._engine_counts),
                "last_step": self.last_step,
                "queued": len(self._queue),
                "queued_bytes": self._queued_bytes,
                "stall_s": round(self.stall_s, 3),
                "capture_s": round(self._capture_s, 4),
                "publisher_cpu_s": round(self._thread_cpu_s, 4),
                "auth_denied": self._auth.denied,  # CURVE keys refused (see security.py)
                "latency": self._latency.summary(),
                "subscribers": subs,
                "groups": groups,
                "departed": list(self._departed),
            }

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued and wait until subscribers acknowledged it (up to
        ``timeout``), tell them, stop. Idempotent.

        Acknowledged, not just handed to ZeroMQ: a large message still in the
        socket's buffers when it closes would be lost, and the END behind it."""
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
            return bool(self._queue) or any(s.queued or s.inflight for s in self._subs.values())

    def _wake(self) -> None:
        """Called with ``_cond`` held, so the pipe is never closed underneath."""
        if not self._stopped.is_set():
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        more = False
        try:
            while True:
                with self._cond:
                    closing = self._closing
                if closing:
                    self._broadcast(END, {"last_step": self.last_step})
                    break
                # Work left that needs no event: do not sleep (no lost wake-ups).
                wait_ms = 0 if more else max(0, int((next_beat - time.monotonic()) * 1000))
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self._monitor in events:
                    self._read_monitor()
                more = False
                if self._sock in events:
                    more = self._read_control()
                more = self._take_items() or more
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self._heartbeat_s
                self._thread_cpu_s = time.thread_time()
        except Exception:  # the engine must never die of the bus
            log.exception("actbus publisher thread failed; capture data is no longer sent")
        finally:
            for s in list(self._subs.values()):
                if s.spill is not None:
                    s.spill.close()
            if self._spill_root is not None:
                shutil.rmtree(self._spill_root, ignore_errors=True)
            self._monitor.close(linger=0)
            self._sock.close(linger=CLOSE_LINGER_MS)  # END reaches live subscribers
            self._auth.close()  # only now: without it, a CURVE socket admits anyone
            self._ctx.term()
            with self._cond:
                self._stopped.set()
                self._closing = True
                self._queue.clear()
                self._cond.notify_all()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _read_monitor(self) -> None:
        while True:
            try:
                msg = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                self._counters["connections_closed"] += 1

    def _read_control(self) -> bool:
        """Handle up to ``CONTROL_BATCH`` messages; True if more may be waiting."""
        for _ in range(CONTROL_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) != 3:
                self._reject(f"{len(frames) - 1} frames after the identity, expected 2")
                continue
            try:
                self._control(*frames)
            except Exception as e:  # one bad message must never end the bus
                self._reject(f"{type(e).__name__}: {e}")
        return True

    def _reject(self, why: str) -> None:
        self._counters["rejected"] += 1
        log.debug("rejected a control message: %s", why)

    def _control(self, ident: bytes, tag: bytes, body: bytes) -> None:
        msg = unpack_map(body)
        now = time.monotonic()
        sub = self._subs.get(ident)
        if tag == HELLO:
            self._hello(ident, msg, now)
        elif tag == CREDIT:
            acked = msg.get("acked")
            if not isinstance(acked, int) or isinstance(acked, bool) or acked < 0:
                raise WireError(f"CREDIT acked must be an int >= 0, got {acked!r:.50}")
            if sub is None:
                self._send_control(ident, REJECT, {"reason": "unknown subscriber; send HELLO"})
                return
            sub.ack(acked)
            sub.last_seen = now
            self._flush(sub)
        elif tag == KEEPALIVE:
            of = msg.get("of")
            if not isinstance(of, bytes):
                raise WireError("KEEPALIVE needs 'of': the subscriber's identity bytes")
            target = self._subs.get(of)
            if target is not None:
                target.last_seen = now
        elif tag == STATS:
            if sub is not None:
                sub.last_seen = now
                self._send_control(ident, STATS, self.stats())
        elif tag == BYE:
            if sub is not None:
                self._remove(sub, "left")
        elif tag == MARK:
            self._mark(sub, msg)
        else:
            raise WireError(f"unknown control tag {tag[:8]!r}")

    def _mark(self, sub: _Sub | None, msg: dict[str, Any]) -> None:
        """Pass a subscriber's mark on to every subscriber (a sink keeping marked requests)."""
        if sub is None:
            raise WireError("MARK from an unknown subscriber; send HELLO first")
        rid, index = msg.get("request_id"), msg.get("sample_index", 0)
        if not isinstance(rid, str) or not rid or len(rid) > 512:
            raise WireError("MARK needs 'request_id': a non-empty string")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise WireError(f"MARK sample_index must be an int >= 0, got {index!r:.50}")
        reason = msg.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 1024:
            raise WireError("MARK reason must be a string under 1024 characters")
        self._counters["marks"] += 1
        body = {"request_id": rid, "sample_index": index, "reason": reason, "by": sub.sub.name}
        self._broadcast(MARK, {**body, "step": self.last_step})

    def _hello(self, ident: bytes, msg: dict[str, Any], now: float) -> None:
        try:
            sub = Subscription.from_wire(msg)
        except WireError as e:
            self._reject(f"HELLO refused: {e}")
            self._send_control(ident, REJECT, {"reason": str(e)})
            return
        with self._cond:
            s = self._subs.get(ident)
            if s is None:
                s = self._subs[ident] = _Sub(
                    ident=ident, sub=sub, last_seen=now, acked_step=self.last_step
                )
                log.info(
                    "subscriber %s joined (policy=%s%s)",
                    sub.name or ident.hex(),
                    s.policy_text(),
                    f", group={sub.group}" if sub.group else "",
                )
            else:
                # The same subscriber again (it thought we went quiet): keep its
                # queue and numbering, so nothing is lost or renumbered.
                self._counters["resubscribed"] += 1
                s.sub, s.last_seen = sub, now
                s.inflight.clear()
                s.inflight_bytes = 0
            self._sub_list = tuple(self._subs.values())
        if s.pending:
            next_seq = s.pending[0][0]
        elif s.spill:
            next_seq = s.spill.head().seq
        else:
            next_seq = s.next_seq
        self._send_control(
            ident,
            WELCOME,
            {**self._info, "schema": SCHEMA_VERSION, "step": self.last_step, "next_seq": next_seq},
        )
        self._flush(s)

    # -------------------------------------------------------------------- routing
    def _can_take(self, item: _Item) -> bool:
        """No lossless subscriber (or every member of a lossless group) is full."""
        if item.tensor is None:
            return True  # a source drop is only counted, never queued
        h = item.header
        groups: dict[str, list[_Sub]] = {}
        for_return = bool(h.ended) or any(h.rows.returned)
        for s in self._subs.values():
            if not s.wants(h.layer, h.hook, for_return):
                continue
            if s.sub.group:
                groups.setdefault(s.sub.group, []).append(s)
            elif s.blocks(item):
                return False
        return all(self._pick(members, item) is not None for members in groups.values())

    def _take_items(self) -> bool:
        """Route queued messages; True if it stopped with work left that needs no event."""
        for _ in range(CONTROL_BATCH):
            with self._cond:
                if not self._queue:
                    return False
                item = self._queue[0]
            if item.payload is None:
                try:
                    item.materialize()
                except Exception:  # one bad message must not end the bus
                    log.exception("actbus: could not encode a message; dropped")
                    self._counters["encode_errors"] += 1
                    for sub in item.counted:
                        sub.queued_out += 1
                    self._pop_item()
                    continue
            if not self._can_take(item):
                return False  # credit (a control message) or a departure unblocks
            self._pop_item()
            self._route_all(item)
        return True

    def _pop_item(self) -> None:
        with self._cond:
            item = self._queue.popleft()
            self._queued_bytes -= item.nbytes
            self._cond.notify_all()

    def _route_all(self, item: _Item) -> None:
        h = item.header
        routed = False
        groups: dict[str, list[_Sub]] = {}
        dropped = item.tensor is None
        lost = False  # some subscriber counted a drop at the source
        for s in list(self._subs.values()):
            if not s.sub.wants(h.layer, h.hook):
                continue
            if dropped and s.lossless:
                continue  # joined after admit() decided: it starts at a later message
            routed = True
            if s.sub.group:
                groups.setdefault(s.sub.group, []).append(s)
            else:
                lost |= self._route(s, item)
        for members in groups.values():
            member = self._pick(members, item)
            assert member is not None  # _can_take checked it
            lost |= self._route(member, item)
        for s in item.counted:
            s.queued_out += 1
        self._routed_step = max(self._routed_step, h.step)
        if dropped:
            self._counters["source_drops"] += lost  # a skipped sample step is not a drop
            return
        if not routed:
            self._counters["unrouted"] += 1
        # Counted once routed to every subscriber, so stats never show a message as
        # published that a subscriber's counters do not yet include.
        self._counters["published"] += 1

    @staticmethod
    def _pick(members: list[_Sub], item: _Item) -> _Sub | None:
        """The group member to take ``item`` (None: wait for one).

        A member with room comes first (credit, then least loaded). When all are
        full, a group with a lossless member waits for one rather than let a lossy
        member's policy drop; otherwise the least loaded member's policy applies.
        """
        free = [s for s in members if not s.overflowing(item.nbytes)]
        if not free:
            lossless = [s for s in members if s.lossless]
            if lossless:
                free = [s for s in lossless if not s.blocks(item)]
                if not free:
                    return None
            else:
                free = members
        return min(
            free,
            key=lambda s: (not s.may_send(item.nbytes), len(s.inflight) + s.queued, s.c.routed),
        )

    def _route(self, s: _Sub, item: _Item) -> bool:
        """Route ``item`` to ``s``; True if that was a drop at the source."""
        policy = s.sub.policy
        if s.skips(item.header.step):
            s.c.sampled_out += 1  # not wanted: neither a drop nor a gap
            return False
        if item.tensor is None:  # dropped at the source (admit): a counted gap
            s.c.routed += 1
            s.next_seq += 1
            s.c.dropped["source"] += 1
            return True
        m = self._variant(item, s.sub)
        if m is None:
            s.c.filtered_out += 1  # no rows for its tag filter: not a gap either
            return False
        s.c.routed += 1
        seq = s.next_seq
        s.next_seq += 1
        if s.overflowing(m.nbytes):
            if policy == "spill" or s.spilled_now:  # nothing overtakes what is spilled
                self._spill(s, seq, m)
                return False
            if policy in ("drop_newest", "sample"):
                s.c.dropped["queue_full"] += 1  # its seq is skipped: a visible gap
                return False
            if policy == "drop_oldest":
                s.pending.popleft()  # the oldest unsent one leaves a gap instead
                s.c.dropped["evicted"] += 1
        s.pending.append((seq, m))
        self._flush(s)
        return False

    def _variant(self, item: _Item, sub: Subscription) -> _Item | None:
        """``item`` cut down to the requests ``sub``'s tag filter keeps (None: nothing
        for it). Made once per distinct filter and message."""
        if not sub.filters_requests:
            return item
        key = repr((sorted((sub.tags or {}).items()), sub.returned_only))
        if item.variants is None:
            item.variants = {}
        if key in item.variants:
            return item.variants[key]
        rows = item.header.rows
        keep = [
            i
            for i in range(len(rows.request_ids))
            if sub.wants_request(rows.request_tags(i), rows.request_returned(i))
        ]
        variant: _Item | None
        if len(keep) == len(rows.request_ids):
            variant = item
        elif not keep and not item.header.ended:
            variant = None  # a message with no rows only matters for its request ends
        else:
            sub_rows, idx = rows.select(keep)
            tensor = item.tensor[torch.from_numpy(idx)].contiguous()
            header = dataclasses.replace(
                item.header, rows=sub_rows, shape=(len(idx), *item.header.shape[1:])
            )
            variant = _Item(header, tensor, header.nbytes, t_published=item.t_published, root=item)
            variant.materialize()
        item.variants[key] = variant
        return variant

    def _spill(self, s: _Sub, seq: int, m: _Item) -> None:
        if s.spill is None:
            s.spill = SpillLog(self._spill_dir() / s.ident.hex())
        size, cap = m.wire_bytes, s.spill_cap
        fallback = s.sub.spill_fallback
        if s.spill.nbytes + size > cap and fallback != "block":
            if fallback == "drop_oldest":
                while s.spill and s.spill.nbytes + size > cap:
                    s.spill.discard()  # the oldest spilled one leaves a gap
                    s.c.dropped["spill_full"] += 1
            if s.spill.nbytes + size > cap:
                s.c.dropped["spill_full"] += 1
                return
        # ``block``: _can_take held the queue until this fitted.
        try:
            s.spill.append(seq, m.header.step, m.header_bytes, m.payload)
        except OSError as e:
            log.error("actbus: spill for %s failed (%s); message dropped", s.sub.name, e)
            s.c.dropped["spill_error"] += 1
            return
        s.c.spilled += 1

    def _spill_dir(self) -> Path:
        if self._spill_root is None:
            root = tempfile.mkdtemp(prefix="actbus-spill-", dir=self._spill_parent)
            self._spill_root = Path(root)
        return self._spill_root

    def _flush(self, s: _Sub) -> None:
        """Send what ``s``'s credit allows: memory first, then what was spilled."""
        while True:
            from_spill = not s.pending
            if s.pending:
                seq, m = s.pending[0]
                nbytes, step = m.nbytes, m.header.step
                if not s.may_send(nbytes):
                    return
                frames = [s.ident, DATA, pack_seq(seq), m.header_bytes, m.payload]
            elif s.spill:
                rec = s.spill.head()
                nbytes, step, seq = rec.payload_len, rec.step, rec.seq
                if not s.may_send(nbytes):
                    return
                try:
                    header_bytes, payload = s.spill.read_head()
                except OSError as e:
                    log.error("actbus: spill read for %s failed (%s)", s.sub.name, e)
                    s.spill.discard()
                    s.c.dropped["spill_error"] += 1
                    continue
                frames = [s.ident, DATA, pack_seq(seq), header_bytes, payload]
            else:
                return
            try:
                self._send_data(frames)
            except zmq.ZMQError as e:
                self._lost(s, e)
                return
            if not from_spill:
                root = m.root or m
                if not root.sent_once:
                    root.sent_once = True
                    self._latency.add(time.monotonic() - root.t_published)
                s.pending.popleft()
            else:
                s.spill.discard()
                s.c.replayed += 1
            s.inflight.append((seq, nbytes, step))
            s.inflight_bytes += nbytes
            s.c.sent += 1
            s.c.bytes_sent += nbytes

    def _send_data(self, frames: list[Any]) -> None:
        """One data message: the small frames copied, the payload zero-copy.

        Sent frame by frame with int flags: ``send_multipart`` rebuilds enum flags
        per frame, which cost more CPU than the rest of routing a message.
        """
        send = self._sock.send
        for f in frames[:-1]:
            send(f, _SNDMORE)
        payload = frames[-1]
        send(payload, 0, copy=len(payload) < zmq.COPY_THRESHOLD)

    # ------------------------------------------------------------------ liveness
    def _sub_stats(self, s: _Sub) -> dict[str, Any]:
        backlog = bool(s.queued or s.inflight)
        return {
            "name": s.sub.name,
            "policy": s.policy_text(),
            "group": s.sub.group,
            **s.c.as_dict(),
            "sampled_out": s.c.sampled_out + s.sampled_at_source,
            "pending": len(s.pending),
            "spill_depth": s.spilled_now,
            "spill_bytes": s.spill.nbytes if s.spill is not None else 0,
            "spill_peak_bytes": s.spill.peak_bytes if s.spill is not None else 0,
            "queue_depth": s.queued,
            "inflight": len(s.inflight),
            "inflight_bytes": s.inflight_bytes,
            "lag_steps": max(0, self.last_step - s.acked_step) if backlog else 0,
        }

    def _heartbeat(self) -> None:
        now = time.monotonic()
        shared = {"published": self._counters["published"], "latency": self._latency.summary()}
        for s in list(self._subs.values()):
            if now - s.last_seen > self._timeout_s:
                log.warning("subscriber %s timed out; no longer waited for", s.sub.name)
                self._remove(s, "timeout")
                continue
            beat = {
                "step": self.last_step,
                "seq": s.next_seq,
                "pending": s.queued,
                "queued": len(self._queue),
                "sent": s.c.sent,
                "dropped": dict(s.c.dropped),
                "you": self._sub_stats(s),
                **shared,
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
        """Forget ``s``: what waited for it is dropped (counted), its spill deleted."""
        lost = s.queued
        if lost:
            s.c.dropped[reason] += lost
        s.pending.clear()
        if s.spill is not None:
            s.spill.close()
        unacked = len(s.inflight)
        with self._cond:
            self._subs.pop(s.ident, None)
            self._sub_list = tuple(self._subs.values())
            final = {**self._sub_stats(s), "reason": reason, "unacked_at_exit": unacked}
            self._departed.append(final)
            if s.sub.group:
                g = self._group_departed.setdefault(s.sub.group, Counter())
                for k in ("routed", "sent", "replayed"):
                    g[k] += getattr(s.c, k)
                g["dropped"] += sum(s.c.dropped.values())
                g["lost_inflight"] += unacked  # may or may not have been processed
        self._counters[f"subscribers_{reason}"] += 1
