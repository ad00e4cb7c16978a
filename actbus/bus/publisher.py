"""The publisher: one ROUTER socket, its thread, session messages and liveness.

The engine thread hands each captured message to ``publish``, which only queues it
(within a byte budget) and returns; a background thread owns the socket and does
all sending. Which subscriber gets what, and what its backpressure policy does
when it has no credit, is decided by ``routing.py`` and ``policies.py``, which
know no sockets: this module gives them a ``send`` and runs them on its thread.
``block`` holds back the shared queue (the engine waits once the budget is
spent); lossy policies never make the engine wait, and ``admit`` lets the engine
skip copying what they would drop anyway.

Subscribers on this host read rows from a shared-memory region instead of the
socket (``shm.py``): negotiated in HELLO/WELCOME, one copy per message for all of
them, its block held for each until it acknowledges the message (``Route.reading``).
The engine's host copies land in the region (``host_tensor``).

Dead subscribers are found two ways: ``ROUTER_MANDATORY`` makes a send to a peer
whose connection closed fail at once (heartbeats go out every ``heartbeat_s``, so
a killed process is noticed within that), and a subscriber silent for
``subscriber_timeout_s`` is dropped. A subscriber keeps itself alive while its
consumer is busy through a keepalive socket of its own (``KEEPALIVE`` names the
subscriber it speaks for). Either way a dead one is no longer waited for.

Every session message that breaks the schema is counted in ``rejected`` and
dropped; frames above ``MAX_SESSION_BYTES`` are refused by libzmq before they are
allocated (the sender's connection is closed; counted in ``connections_closed``).

Every peer is untrusted, and what one can cost is bounded: its credit (a HELLO
asking more than ``max_window_mb`` or ``MAX_WINDOW`` messages is refused), its
acknowledgements (never beyond what was sent), its ZeroMQ queue (``PEER_QUEUE``
messages: a peer whose queue fills is not reading, and is dropped and counted as
``not_reading``, never buffered), its request filter (size-bounded, compiled
once), the number of subscribers (``max_subscribers``), its STATS requests (one
answer per ``STATS_INTERVAL_S``), the session messages handled per loop turn, and
the log lines it causes (``logcap.LogRate``). Stats name subscribers, never
their identities.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from actbus.bus.farewell import held
from actbus.bus.leases import Retired, open_pidfd, parse_pid, parse_viewing
from actbus.bus.outlet import Admission, TapOffer
from actbus.bus.protocol import MAX_VIEWING, MAX_WINDOW, Subscription
from actbus.bus.routing import Item, Route, Router
from actbus.bus.security import ServerAuth
from actbus.bus.shm import DEFAULT_SHM_MB, DESCRIPTOR, Region, ShmError, same_host
from actbus.logcap import LogRate, capped, capped_text
from actbus.wire import (
    BYE,
    CREDIT,
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
    unpack_map,
)

log = logging.getLogger("actbus.publisher")

# How long the socket may still deliver END (and what was sent) once closed.
CLOSE_LINGER_MS = 1000
_NOWAIT = int(zmq.NOBLOCK)
_SNDMORE_NOWAIT = int(zmq.SNDMORE) | _NOWAIT
# Largest session frame accepted; session messages are small maps (a HELLO's
# request filter is at most protocol.MAX_MATCH_BYTES).
MAX_SESSION_BYTES = 64 << 10
# Session messages handled per loop turn, and the time they may take, so a flood
# cannot starve sending.
SESSION_BATCH = 256
SESSION_TURN_S = 0.02
DEPARTED_KEPT = 32
# Messages ZeroMQ may hold for one peer (its send high-water mark): credit bounds
# the data in flight to MAX_WINDOW, the rest is room for heartbeats, marks and
# stats. A live subscriber's queue drains as it arrives (its socket reads into
# its own process); a full one means the peer stopped reading: it is dropped.
PEER_QUEUE = MAX_WINDOW + 1024
PEER_INBOX = 64
"""Session messages one peer may have waiting unread in the publisher's socket."""
DEFAULT_MAX_WINDOW_MB = 256.0
DEFAULT_MAX_SUBSCRIBERS = 256
# A subscriber's STATS requests answered at most this often; the counters are
# rebuilt at most this often whoever asks.
STATS_INTERVAL_S = 0.1
_NO_ROWS = torch.empty(0, dtype=torch.uint8)


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
        max_window_mb: float = DEFAULT_MAX_WINDOW_MB,
        max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
        shm_mb: float = DEFAULT_SHM_MB,
    ) -> None:
        """``max_window_mb``: the credit in MiB one subscriber may ask for (what it may
        have in flight, unread); ``max_subscribers``: how many may subscribe at once.
        A HELLO beyond either is refused with a REJECT naming the bound. ``shm_mb``:
        the shared-memory region that subscribers on this host read from (made when
        the first of them subscribes; 0: they use the socket too)."""
        self.address = address
        self.id = uuid.uuid4().hex
        self._info = {**info, "publisher_id": self.id, "heartbeat_s": heartbeat_s}
        self._queue_budget = queue_bytes
        self._max_window_mb = max_window_mb
        self._max_window_bytes = int(max_window_mb * (1 << 20))
        self._max_subscribers = max_subscribers
        self._shm_bytes = int(shm_mb * (1 << 20))
        self._region: Region | None = None  # made by the publisher thread, read by any
        self._shm_failed = False
        self._retired = Retired()  # blocks departed subscribers may still view
        self._heartbeat_s = heartbeat_s
        self._timeout_s = subscriber_timeout_s
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
        self._sock.setsockopt(zmq.SNDHWM, PEER_QUEUE)  # full: that peer is dropped
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_SESSION_BYTES)
        # What one peer may have waiting unread here: past it libzmq stops reading
        # that peer (its sends block), so a flood costs at most this x 64 KiB.
        self._sock.setsockopt(zmq.RCVHWM, PEER_INBOX)
        try:
            self._auth.apply(self._ctx, self._sock)  # CURVE + authenticator, before bind
            # libzmq replaces an ipc path's socket file when it binds: a stale one (its
            # publisher killed) is meant to go, a live publisher's is not.
            if address.startswith("ipc://") and held(address):
                raise zmq.ZMQError(
                    zmq.EADDRINUSE, "a live process accepts connections there already"
                )
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._auth.close()
            self._ctx.term()
            raise OSError(f"actbus.publish={address!r}: cannot bind: {e}") from e
        self._socket_events = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._socket_file = _socket_file(address)
        self._queue: deque[Item] = deque()
        self._queued_bytes = 0
        self._queued_bytes_peak = 0  # the most the queue held: how far the engine ran ahead
        # Queued messages still in pinned (page-locked) staging memory, oldest first:
        # what ``_unpin_backlog`` moves out once their device copy is done.
        self._pinned: deque[Item] = deque()
        self.unpinned = 0  # messages moved from pinned to pageable memory while queued
        self._held_back = False  # the last turn stopped at a message that must wait
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Routes under ``_cond`` (the engine thread reads its snapshot without it);
        # spill directories go under ``spill_dir`` (None: the system temp dir).
        self._router = Router(self._send_data, spill_dir=spill_dir)
        self._subs = self._router.routes  # the same dict: subscribers by identity
        self._counters: Counter[str] = Counter()  # this thread's (routing counts its own)
        self._engine_counts: Counter[str] = Counter()  # written by the engine thread only
        self._departed: deque[dict[str, Any]] = deque(maxlen=DEPARTED_KEPT)
        self._peer_log = LogRate()  # lines peers cause (this thread's)
        self._stats_wire: tuple[float, bytes] = (-math.inf, b"")  # STATS' body, when built
        self._stats_owed: dict[bytes, float] = {}  # subscribers owed an answer: when due
        self._stats_due = math.inf  # the earliest of those
        self._group_departed: dict[str, Counter[str]] = {}
        self._closing = False
        self._closed = False
        self._stopped = threading.Event()
        self.stall_s = 0.0  # time the engine spent waiting for queue space
        self._capture_s = 0.0  # engine thread: time spent in actbus (count_step)
        self._thread_cpu_s = 0.0  # the publisher thread's CPU time, as of its last turn
        self._thread = threading.Thread(target=self._run, name="actbus-publisher", daemon=True)
        self._thread.start()

    @property
    def last_step(self) -> int:
        """The newest step routed, or skipped at the source by every sampler."""
        return self._router.last_step

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

    def admit(self, step: int, taps: Sequence[TapOffer]) -> list[Admission]:
        """Which taps of a step are worth copying, one ``TapOffer`` per tap, in the
        order the engine will publish them.

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
        budget = self._queue_budget - self._queued_bytes
        return self._router.admit(step, taps, budget, first=not self._queue)

    def drop(self, header: Header) -> None:
        """Record a message that ``admit`` said to drop: each lossy subscriber of its
        tap counts a drop (reason ``source``) and sees a gap. Request ends it carries
        still go out, in a message with no rows."""
        item = Item(header, None, 0, None, time.monotonic())
        ends = None
        if header.shape[0] == 0:  # no rows to lose: only its request ends matter
            item = None
        if header.ended:
            end_header = dataclasses.replace(
                header, shape=(0, *header.shape[1:]), rows=RowIndex.empty()
            )
            ends = Item(end_header, _NO_ROWS, 0, None, time.monotonic())
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

    def host_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Fresh host memory for a message's rows, in the shared-memory region when
        subscribers on this host read from one (pinned on CUDA): what the engine's
        device-to-host copy lands in, so local subscribers read it with no further
        copy. None: no region, or no room in it now (use ordinary memory)."""
        region = self._region
        if region is None or self._closing:
            return None
        return region.tensor(shape, dtype)

    def publish(self, header: Header, tensor: torch.Tensor, *, ready: Any = None) -> None:
        """Queue one message; waits (lossless) only while the byte budget is spent.

        ``ready``, if given, is an event (e.g. ``torch.cuda.Event``) that must complete
        before ``tensor`` and the header's row index hold their data.
        """
        item = Item(header, tensor.contiguous(), header.nbytes, ready, time.monotonic())
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
            item.counted = self._router.counting(header)
            for s in item.counted:
                s.queued_in += 1
            self._queue.append(item)
            if item.ready is not None and not self._in_region(item.tensor):
                self._pinned.append(item)  # a device copy into torch's pinned staging memory
            self._queued_bytes += item.nbytes
            self._queued_bytes_peak = max(self._queued_bytes_peak, self._queued_bytes)
            if was_empty:
                self._wake()

    def stats(self) -> dict[str, Any]:
        """Every counter: global, per subscriber, per group, and recent departures."""
        with self._cond:
            subs: dict[str, dict[str, Any]] = {}
            for s in list(self._subs.values()):
                # Keyed by name, made unique by the subscriber's serial (names need not
                # be unique); never by its identity, which peers must not learn.
                key = s.sub.name or f"#{s.serial}"
                if key in subs:
                    key = f"{s.sub.name}#{s.serial}"
                    while key in subs:  # a name made to look like another's key
                        key += "#"
                subs[key] = s.stats(self.last_step)
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
                **dict(self._router.counters),
                **dict(self._engine_counts),
                **dict(self._router.engine_counts),
                "last_step": self.last_step,
                "queued": len(self._queue),
                "queued_bytes": self._queued_bytes,
                "queued_bytes_peak": self._queued_bytes_peak,
                "unpinned": self.unpinned,
                "pinned_host": _pinned_host(),
                "stall_s": round(self.stall_s, 3),
                "capture_s": round(self._capture_s, 4),
                "publisher_cpu_s": round(self._thread_cpu_s, 4),
                "shm": {
                    **region.stats(),
                    "retired_blocks": self._retired.held,
                    "retired_released": self._retired.released,
                }
                if (region := self._region) is not None
                else {},
                "auth_denied": self._auth.denied,  # CURVE keys refused (see security.py)
                "log_lines_held": self._peer_log.held_total,
                "latency": self._router.latency.summary(),
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

    def _remove_socket_file(self) -> None:
        """After END, an ``ipc://`` socket file goes: one left behind means the
        publisher died without END, and its subscribers still wait (the engine's
        front end then tells them: ``actbus.bus.farewell``). Only the file this
        publisher bound is removed, never one another process bound since."""
        if self._socket_file is None:
            return
        path, inode = self._socket_file
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)

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
        ended = False
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._socket_events, zmq.POLLIN)
        next_beat = time.monotonic()
        more = False
        try:
            while True:
                with self._cond:
                    closing = self._closing
                if closing:
                    self._broadcast(END, {"last_step": self.last_step})
                    ended = True
                    break
                # Work left that needs no event: do not sleep (no lost wake-ups).
                wake_at = min(next_beat, self._stats_due) if self._stats_owed else next_beat
                wait_ms = 0 if more else max(0, int((wake_at - time.monotonic()) * 1000) + 1)
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self._socket_events in events:
                    self._read_socket_events()
                more = False
                if self._sock in events:
                    more = self._read_session()
                more = self._take_items() or more
                more = self._unpin_backlog(held_back=self._held_back) or more
                if self._stats_owed and time.monotonic() >= self._stats_due:
                    self._answer_owed_stats()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self._heartbeat_s
                self._thread_cpu_s = time.thread_time()
        except Exception:  # the engine must never die of the bus
            log.exception("actbus publisher thread failed; capture data is no longer sent")
        finally:
            self._router.close()  # deletes every spill
            for s in self._subs.values():
                if s.pidfd is not None:
                    os.close(s.pidfd)
            self._retired.close()
            region, self._region = self._region, None  # the engine allocates no more
            if region is not None:
                region.close()  # its memory goes with the last block and mapping
            self._socket_events.close(linger=0)
            self._sock.close(linger=CLOSE_LINGER_MS)  # END reaches live subscribers
            self._auth.close()  # only now: without it, a CURVE socket admits anyone
            self._ctx.term()
            if ended:
                self._remove_socket_file()
            with self._cond:
                self._stopped.set()
                self._closing = True
                self._queue.clear()
                self._pinned.clear()
                self._cond.notify_all()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _read_socket_events(self) -> None:
        while True:
            try:
                msg = parse_monitor_message(self._socket_events.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                self._counters["connections_closed"] += 1

    def _read_session(self) -> bool:
        """Handle up to ``SESSION_BATCH`` messages, for up to ``SESSION_TURN_S``;
        True if more may be waiting."""
        stop = time.monotonic() + SESSION_TURN_S
        for _ in range(SESSION_BATCH):
            if time.monotonic() > stop:
                return True
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if len(frames) != 3:
                self._reject(f"{len(frames) - 1} frames after the identity, expected 2")
                continue
            try:
                self._on_session(*frames)
            except Exception as e:  # one bad message must never end the bus
                self._reject(f"{type(e).__name__}: {e}")
        return True

    def _reject(self, why: str) -> None:
        self._counters["rejected"] += 1
        self._peer_log.log(log, logging.DEBUG, "rejected a session message: %s", capped_text(why))

    def _on_session(self, ident: bytes, tag: bytes, body: bytes) -> None:
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
                self._send_session(ident, REJECT, {"reason": "unknown subscriber; send HELLO"})
                return
            proof = msg.get("proof")
            if proof is not None and not isinstance(proof, bytes):
                raise WireError(f"CREDIT proof must be bytes, got {type(proof).__name__}")
            # refuses an ack beyond what was sent, or without the receipt (WireError)
            sub.ack(acked, proof)
            sub.last_seen = now
            sub.flush()
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
                self._answer_stats(sub, now)
        elif tag == BYE:
            viewing = parse_viewing(msg.get("viewing"), MAX_VIEWING)
            if sub is not None:
                self._remove(sub, "left", viewing)
        elif tag == MARK:
            self._mark(sub, msg)
        else:
            raise WireError(f"unknown session tag {tag[:8]!r}")

    def _mark(self, sub: Route | None, msg: dict[str, Any]) -> None:
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

    def _answer_stats(self, sub: Route, now: float) -> None:
        """The counters, at most once per ``STATS_INTERVAL_S`` per subscriber: what
        it asks sooner is answered once, when the interval is up (counted in
        ``stats_deferred``). Rebuilt at most that often, so many subscribers asking
        as fast as they can cost the thread one build a period, and a peer that
        asks without reading queues one answer a period."""
        due = sub.stats_answered + STATS_INTERVAL_S
        if now < due:
            self._counters["stats_deferred"] += 1
            if sub.ident not in self._stats_owed:
                self._stats_owed[sub.ident] = due
                self._stats_due = min(self._stats_owed.values())
            return
        sub.stats_answered = now
        built, body = self._stats_wire
        if now - built >= STATS_INTERVAL_S:
            body = pack_map(self.stats())
            self._stats_wire = (now, body)
        self._send_frames(sub.ident, STATS, body)

    def _answer_owed_stats(self) -> None:
        now = time.monotonic()
        for ident, due in list(self._stats_owed.items()):
            if due <= now:
                del self._stats_owed[ident]
                sub = self._subs.get(ident)
                if sub is not None:
                    self._answer_stats(sub, now)
        self._stats_due = min(self._stats_owed.values(), default=math.inf)

    def _refusal(self, sub: Subscription, new: bool) -> str | None:
        """Why a checked HELLO is refused by this publisher's limits (None: it is not)."""
        asked = sub.window_bytes
        if asked > self._max_window_bytes:
            return (
                f"window_bytes={asked} ({asked / (1 << 20):g} MiB) is above this publisher's "
                f"limit of {self._max_window_mb:g} MiB per subscriber (its "
                f"actbus.max_window_mb); ask for at most that (--window-mb)"
            )
        if new and len(self._subs) >= self._max_subscribers:
            return (
                f"this publisher serves at most {self._max_subscribers} subscribers at once "
                "(its actbus.max_subscribers), and has that many; try again when one leaves"
            )
        return None

    def _hello(self, ident: bytes, msg: dict[str, Any], now: float) -> None:
        try:
            sub = Subscription.from_wire(msg)
            viewing = parse_viewing(msg.get("viewing"), MAX_VIEWING)
        except WireError as e:
            self._reject(f"HELLO refused: {e}")
            self._send_session(ident, REJECT, {"reason": str(e)})
            return
        why = self._refusal(sub, new=ident not in self._subs)
        if why is not None:
            self._reject(f"HELLO refused: {why}")
            self._counters["subscribers_refused"] += 1
            self._peer_log.log(log, logging.WARNING, "subscriber refused: %s", why)
            self._send_session(ident, REJECT, {"reason": why})
            return
        with self._cond:
            s, new = self._router.subscribe(ident, sub, now)
        if new:  # blocks it was sent before it was dropped: those it no longer views go
            self._retired.settle(ident, viewing)
        # A filtered subscriber reads from the socket: the region holds every
        # request's rows, and its mapping would show it those its filter cuts out.
        region = None if sub.filters_requests else self._local_region(msg.get("shm"), s)
        s.share = self._share if region is not None else None
        if new:
            self._peer_log.log(
                log,
                logging.INFO,
                "subscriber %s joined (policy=%s%s)",
                _who(s),
                s.policy,
                f", group={capped(sub.group)}" if sub.group else "",
            )
        else:  # the same subscriber again: its queue and numbering are kept
            self._counters["resubscribed"] += 1
        welcome = {
            **self._info,
            "schema": SCHEMA_VERSION,
            "step": self.last_step,
            "next_seq": s.next_unsent,
        }
        if region is not None:
            welcome["shm"] = region.offer()
        if self._send_session(ident, WELCOME, welcome):  # else it was dropped
            s.flush()

    # ------------------------------------------------------------- shared memory
    def _local_region(self, facts: Any, s: Route) -> Region | None:
        """The region for a subscriber whose HELLO says it runs on this host as this
        user (``shm.host_facts``), made on first use; None: it gets the socket path.
        Its process is known by a pidfd (``leases.py``: the blocks it may still view
        are never recycled before it exits); without one it reads from the socket."""
        if not same_host(facts) or self._shm_bytes <= 0 or self._shm_failed:
            return None
        if s.pidfd is None:
            pid = parse_pid(facts)
            if self._retired.full or pid is None:
                self._counters["shm_refused"] += 1
                return None
            s.pidfd = open_pidfd(pid)
            if s.pidfd is None:
                self._counters["shm_refused"] += 1
                return None
        if self._region is None:
            try:
                pin = torch.cuda.is_available() and torch.cuda.is_initialized()
                self._region = Region(self._shm_bytes, pin=pin)
            except ShmError as e:
                self._shm_failed = True
                log.warning("actbus: subscribers on this host use the socket: %s", e)
                return None
        return self._region

    def _in_region(self, t: torch.Tensor | None) -> bool:
        region = self._region
        return region is not None and t is not None and region.offset(t) is not None

    def _share(self, m: Item) -> tuple[bytes, torch.Tensor] | None:
        """``m``'s rows in the region: where the engine copied them, or copied in here
        once for every local subscriber (None: no room now; they go over the socket)."""
        if m.shared is None:
            region, t = self._region, m.tensor
            if region is None or t is None:
                return None
            off = region.offset(t)
            if off is None:
                t = region.stage(t)  # one copy, whoever reads it
                if t is None:
                    return None
                off = region.offset(t)
            m.shared = (DESCRIPTOR.pack(off, m.nbytes), t)
        return m.shared

    # -------------------------------------------------------------------- routing
    def _take_items(self) -> bool:
        """Route queued messages; True if it stopped with work left that needs no event.
        ``_held_back`` says whether it stopped at a message that must wait (credit)."""
        self._held_back = False
        for _ in range(SESSION_BATCH):
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
                    self._router.done(item)
                    self._pop_item()
                    continue
            if not self._router.can_take(item):
                self._held_back = True
                return False  # credit (a session message) or a departure unblocks
            self._pop_item()
            self._router.route_all(item)
        return True

    def _unpin_backlog(self, *, held_back: bool) -> bool:
        """Move the messages held back in the queue this turn out of pinned memory.

        The engine stages device-to-host copies in torch's pinned-memory cache, which
        reuses a block once its message is sent. A message that waits (a slow
        subscriber, ``block``, credit) keeps its block, so with a backlog every new
        step misses the cache and ``cudaHostAlloc`` runs on the engine's thread
        (measured at 2.2 ms a call on an H100 host, a call or two a step). Here, on
        this thread and without the GIL, each waiting message whose copy is done is
        copied into ordinary memory, and its pinned block goes back to the cache for
        the next step. What was sent at once (a subscriber keeping up) is never copied:
        only a turn that stopped at a message that must wait (``held_back``) copies.
        Bounded to ``SESSION_TURN_S`` a turn; True if it stopped with copies left.
        """
        pinned = self._pinned
        while pinned and pinned[0].left_queue:  # sent (or dropped): staging is torch's again
            pinned.popleft()
        if not held_back:
            return False
        stop = time.monotonic() + SESSION_TURN_S
        # The rest are still queued: only this thread takes from the queue.
        while pinned:  # in publish order, the order the side stream copies them
            item = pinned[0]
            if item.ready is not None:
                if not item.ready.query():
                    return False  # its copy is under way: the next turn takes it
                item.ready = None
            if time.monotonic() > stop:
                return True
            item.unpin()
            self.unpinned += 1
            pinned.popleft()
        return False

    def _pop_item(self) -> None:
        with self._cond:
            item = self._queue.popleft()
            item.left_queue = True
            self._queued_bytes -= item.nbytes
            self._cond.notify_all()

    def _send_data(self, frames: list[Any]) -> bool:
        """One data message (routing's ``send``): the small frames copied, the
        payload zero-copy. False: the subscriber is gone, and was removed.

        Sent frame by frame with int flags: ``send_multipart`` rebuilds enum flags
        per frame, which cost more CPU than the rest of routing a message. Never
        waits: only the first frame can fail (the peer is gone, or its queue is
        full), and then nothing of the message was queued.
        """
        send = self._sock.send
        try:
            for f in frames[:-1]:
                send(f, _SNDMORE_NOWAIT)
            payload = frames[-1]
            send(payload, _NOWAIT, copy=len(payload) < zmq.COPY_THRESHOLD)
        except zmq.ZMQError as e:
            self._failed(frames[0], e)
            return False
        return True

    # ------------------------------------------------------------------ liveness
    def _heartbeat(self) -> None:
        self._retired.poll()  # blocks of departed subscribers whose process exited
        now = time.monotonic()
        latency = self._router.latency.summary()
        shared = {"published": self._router.counters["published"], "latency": latency}
        for s in list(self._subs.values()):
            if now - s.last_seen > self._timeout_s:
                self._peer_log.log(
                    log, logging.WARNING, "subscriber %s timed out; no longer waited for", _who(s)
                )
                self._remove(s, "timeout")
                continue
            beat = {
                "step": self.last_step,
                "seq": s.next_seq,
                "pending": s.queued,
                "queued": len(self._queue),
                "sent": s.c.sent,
                "dropped": dict(s.c.dropped),
                "you": s.stats(self.last_step),
                **shared,
            }
            self._send_session(s.ident, HEARTBEAT, beat)

    def _broadcast(self, tag: bytes, body: dict[str, Any]) -> None:
        packed = pack_map(body)
        for s in list(self._subs.values()):
            self._send_frames(s.ident, tag, packed)

    def _send_session(self, ident: bytes, tag: bytes, body: dict[str, Any]) -> bool:
        return self._send_frames(ident, tag, pack_map(body))

    def _send_frames(self, ident: bytes, tag: bytes, body: bytes) -> bool:
        """One session message; never waits. False: not sent (a subscriber it was
        for is removed)."""
        try:
            self._sock.send_multipart([ident, tag, body], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            self._failed(ident, e, session=True)
            return False

    def _failed(self, ident: bytes, err: zmq.ZMQError, session: bool = False) -> None:
        """A send to ``ident`` failed: if it is a subscriber, it is dropped and counted
        (a closed connection found by a session message, as a subscriber leaves, quietly)."""
        s = self._subs.get(ident)
        if s is None:
            return  # a peer that never subscribed: nothing waits for it
        if err.errno == zmq.EHOSTUNREACH:
            what, reason = "disconnected", "disconnected"
        elif err.errno == zmq.EAGAIN:
            what, reason = f"stopped reading ({PEER_QUEUE} messages queued)", "not_reading"
        else:
            what, reason = f"could not be sent to ({capped_text(str(err))})", "send_error"
        if not (session and reason == "disconnected"):
            self._peer_log.log(
                log, logging.WARNING, "subscriber %s %s; no longer waited for", _who(s), what
            )
        self._remove(s, reason)

    def _remove(self, s: Route, reason: str, viewing: frozenset[int] | None = None) -> None:
        """Forget ``s``: what waited for it is dropped (counted), its spill deleted.
        The region blocks it was sent are retired, not freed (``leases.py``): it may
        still view them (all, or those its BYE names in ``viewing``)."""
        if s.pidfd is not None:
            kept = [(seq, t) for seq, t in s.reading if viewing is None or seq in viewing]
            self._retired.retire(s.ident, s.pidfd, kept)
            s.pidfd = None
        unacked = s.close(reason)
        with self._cond:
            self._router.discard(s)
            final = {**s.stats(self.last_step), "reason": reason, "unacked_at_exit": unacked}
            self._departed.append(final)
            if s.sub.group:
                g = self._group_departed.setdefault(s.sub.group, Counter())
                for k in ("routed", "sent", "replayed"):
                    g[k] += getattr(s.c, k)
                g["dropped"] += sum(s.c.dropped.values())
                g["lost_inflight"] += unacked  # may or may not have been processed
        self._counters[f"subscribers_{reason}"] += 1


def _pinned_host() -> dict[str, float]:
    """This process's page-locked host memory as torch's pinned allocator counts it
    (staging buffers wait there for slow subscribers; growing it costs the engine
    thread ``cudaHostAlloc`` time): empty where CUDA is not in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return {}
    keep = ("allocated_bytes.current", "num_host_alloc", "host_alloc_time.total")
    return {k: float(v) for k, v in stats().items() if k in keep}


def _who(s: Route) -> str:
    """A subscriber in a log line: its name, quoted and capped, or its serial."""
    return capped(s.sub.name) if s.sub.name else f"#{s.serial}"


def _socket_file(address: str) -> tuple[str, int] | None:
    """The path and inode of the file an ``ipc://`` bind made (None: tcp, abstract)."""
    path = address.removeprefix("ipc://")
    if path == address or path.startswith("@"):
        return None
    try:
        return path, os.stat(path).st_ino
    except OSError:
        return None
