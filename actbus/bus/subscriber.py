"""The subscriber: a DEALER that asks for a subscription and grants credit.

Iterating a ``Subscriber`` yields ``Batch`` objects whose tensors are made
zero-copy over the received frames, or, on the publisher's host, over its
shared-memory region (``shm.py``: the socket then carries only descriptors). Credit
is a cumulative acknowledgement ("all below seq N arrived or is known lost"; on the
region path, "and is no longer viewed": a region message is acknowledged only once
every view of it is gone, so its block is never reused under a reader), sent after
half a window and at least
every 0.5 s while ``recv`` is called; it doubles as the subscriber's heartbeat.
While the consumer is busy between ``recv`` calls (a slow ``on_batch``), a
background thread keeps the publisher informed with KEEPALIVE messages on a socket
of its own (zmq sockets are not thread-safe), naming this subscriber's identity;
so a slow consumer is never mistaken for a dead one, while a killed or stopped
process falls silent and is dropped. ``max_busy_s`` bounds how long a consumer
that never comes back to ``recv`` is covered.

If the publisher goes quiet (restart, kill, not started yet) for ``silence_s``,
HELLO is sent again, so a subscriber started before the publisher, or surviving a
publisher restart, needs no help from its user; while no publisher answers, it logs
every ``WAITING_LOG_S`` what it waits for. A publisher that is quiet while its
connection stays up is alive and busy (an engine warming up starves its publisher's
thread): one INFO line says so, and the subscription stands. Each publisher's first
WELCOME is logged once: who answered, and what this subscription takes from it.
HELLOs queued while no publisher was there are all answered at once: only the first
WELCOME of a publisher is an event. A WELCOME that says the publisher taps none of some
layer or hook asked for ends the subscription (``SubscriptionRejected``): what was asked
for would never come. Every message the publisher dropped for us shows up in
``stats.missed``; every message that breaks the schema is dropped and counted in
``stats.rejected``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from actbus.bus.protocol import (
    MAX_VIEWING,
    MAX_WINDOW,
    Subscription,
    frame_limit,
    recv_queue,
)
from actbus.bus.security import ClientAuth
from actbus.bus.shm import Mapping, ShmError, host_facts, wanted_by_default
from actbus.logcap import capped, capped_text
from actbus.wire import (
    BYE,
    CREDIT,
    DATA,
    END,
    HEARTBEAT,
    HELLO,
    KEEPALIVE,
    MARK,
    MONITOR_HOOK,
    REGION,
    REJECT,
    STATS,
    WELCOME,
    Header,
    WireError,
    frame_to_tensor,
    pack_map,
    publisher_identity,
    unpack_map,
    unpack_seq,
)

log = logging.getLogger("actbus.subscriber")
IDLE_COPY_S = 0.1
"""Region batches still kept this long after the last message are copied out, so
their acknowledgement does not wait on the consumer (``Subscriber._shm_service``)."""
WAITING_LOG_S = 5.0
"""While no publisher answers, a line every this many seconds says what we wait for."""
MISSING_SOCKET_S = 1.0
"""An ``ipc://`` address whose socket file is still missing after this long is said at
once (then in every waiting line): a path typed wrong, or a publisher not started."""


class SubscriptionRejected(RuntimeError):
    """The publisher refused the subscription; the message says why."""


def check_taps(
    address: str,
    info: dict[str, Any],
    layers: tuple[int, ...] | None,
    hooks: tuple[str, ...] | None,
) -> None:
    """Refuse (``SubscriptionRejected``) a stream that cannot carry what is asked for:
    a publisher's WELCOME says what it taps (an engine's ``layers`` and ``hooks``, or a
    replayed run's). ``None`` asks for all; a publisher that does not say is trusted."""
    monitors = info.get("monitors") if isinstance(info.get("monitors"), dict) else {}
    for what, wanted, key in (("layer", layers, "layers"), ("hook", hooks, "hooks")):
        tapped = info.get(key)
        if monitors and isinstance(tapped, list) and hooks is not None and MONITOR_HOOK in hooks:
            # Monitor scores come from the monitors' own layers, on the monitors' score hook.
            extra = (
                [MONITOR_HOOK]
                if key == "hooks"
                else [
                    x for m in monitors.values() if isinstance(m, dict) for x in m.get("layers", [])
                ]
            )
            tapped = tapped + extra
        if wanted is None or not isinstance(tapped, list):
            continue
        missing = [w for w in wanted if w not in tapped]
        if missing:
            names = ", ".join(map(str, missing))
            raise SubscriptionRejected(
                f"the publisher at {address} taps layers {info.get('layers')} and hooks "
                f"{info.get('hooks')}, not {what}{'s' if len(missing) > 1 else ''} {names} "
                f"asked for here: subscribe to what it taps, or start the publisher tapping "
                f"{names} (actbus serve --{key})"
            )


@dataclass(frozen=True)
class Source:
    """Which publisher a batch or event came from: its address, its run
    (``publisher_id``, new at each start, so a restarted publisher's run is told apart)
    and, for an engine under data parallelism, its rank (``dp_rank``). Request ids are
    unique per source, not across sources."""

    address: str
    publisher_id: str | None = None
    dp_rank: int | None = None

    def __str__(self) -> str:
        out = f"{self.address}#{self.publisher_id}" if self.publisher_id else self.address
        return out if self.dp_rank is None else f"{out} (dp rank {self.dp_rank})"


@dataclass
class Batch:
    """One step of one (layer, hook): rows of activations and whose they are."""

    header: Header
    tensor: torch.Tensor  # [rows, hidden], read-only view over the received frame
    seq: int
    source: Source | None = None
    """The publisher it came from (several under fan-in: ``actbus.bus.fanin``)."""
    shared: bool = False
    """``tensor`` is a view of the publisher's shared memory (``Subscriber``): held, it
    holds back this subscriber's credit; ``keep`` gives rows to hold for long."""

    def keep(self) -> torch.Tensor:
        """The rows, to hold past this batch (buffered for seconds, encoded zero-copy
        into something kept): a private copy when they are a view of the publisher's
        shared memory, so neither its blocks nor this subscriber's credit wait on
        them; the tensor itself when it came on the socket."""
        return self.tensor.clone() if self.shared else self.tensor

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
    """A session event surfaced to the consumer loop (heartbeat or end of stream)."""

    kind: str  # "heartbeat" | "end" | "welcome" | "stats" | "mark"
    body: dict[str, Any]
    source: Source | None = None


@dataclass
class SubscriberStats:
    received: int = 0
    bytes_received: int = 0
    missed: int = 0  # sequence-number gaps: messages the publisher dropped for us
    rejected: int = 0  # messages that broke the schema: dropped, counted
    rejected_by: dict[str, int] = field(default_factory=dict)
    """``rejected`` by the header field at fault (``WireError.field``)."""
    welcomes: int = 0
    lost: int = 0
    """Times the publisher went quiet without saying goodbye (killed, unreachable)."""
    last_step: int = -1
    publisher_step: int = -1  # the publisher's last published step, from heartbeats
    publisher_view: dict[str, Any] = field(default_factory=dict)
    """The publisher's counters for this subscriber (sent, dropped by reason, spilled,
    replayed, queue depth, lag), from the latest heartbeat."""
    path: str = "socket"
    """How rows arrive: ``shm`` (read from the publisher's shared-memory region, on its
    host) or ``socket`` (the bytes on the socket), as the last WELCOME settled."""
    shm_received: int = 0
    """Messages read from the region (the rest of ``received`` came on the socket)."""
    copied_out: int = 0
    """Region messages copied into private memory because the consumer kept them while
    they held half its credit (so the publisher could reuse their blocks)."""
    evicted: int = 0
    """Times the publisher had dropped this subscriber (silent past its
    ``subscriber_timeout_s``, or not reading) and it subscribed again: what was sent
    meanwhile is lost. Views it held stay valid (the publisher retires their blocks)."""


class Subscriber:
    """Connects to a publisher and yields batches under one subscription."""

    def __init__(
        self,
        address: str,
        subscription: Subscription | None = None,
        *,
        silence_s: float = 3.0,
        keepalive: bool = True,
        max_busy_s: float | None = None,
        server_key: str | None = None,
        client_secret_key: str | None = None,
        context: zmq.Context | None = None,
        waiting_for: str | None = None,
        shm: bool | None = None,
    ) -> None:
        """``context``: a ZeroMQ context to share (a ``FanIn``'s, whose subscribers then
        cost no I/O threads of their own); without one, the subscriber has its own.
        ``keepalive=False``: the caller sends the KEEPALIVEs (``keepalive_socket`` and
        ``beat``), as a ``FanIn`` does for all its subscribers from one thread.
        ``waiting_for``: what the waiting and connected lines say this subscriber is
        for (default: what ``subscription`` asks). ``shm``: read rows from the
        publisher's shared memory when it runs on this host (None: unless
        ``ACTBUS_SHM=0``); a batch's tensor is then a view of that memory, mapped
        read-only (writing into it is a SIGSEGV: clone first), valid while referenced:
        the publisher reuses it only after every view of it is gone (and kept batches
        are copied out once they hold back half the credit)."""
        self.address = address
        self._waiting_for = waiting_for
        # CURVE keys (checked now: ConfigError names a bad path), and handshake watching.
        self._auth = ClientAuth(address, server_key=server_key, client_secret_key=client_secret_key)
        self.subscription = subscription or Subscription()
        self.silence_s = silence_s
        self.max_busy_s = max_busy_s
        self.stats = SubscriberStats()
        self.welcome: dict[str, Any] | None = None
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._ident = uuid.uuid4().bytes
        self._sock = self._make_socket(self._ident)
        self._next_seq = 0  # lowest seq not yet received (or known lost)
        self._receipt: tuple[int, bytes] | None = None  # the newest message read: seq, proof
        self._shm = wanted_by_default() if shm is None else shm
        self._mapping: Mapping | None = None
        self._mapped_for: str | None = None  # the publisher run the mapping is of
        # Region messages whose views are still referenced: seq -> (nbytes, the batch);
        # below the lowest of them nothing is acknowledged (their blocks stay ours).
        # Each: [nbytes, the batch (weak), copied out already].
        self._held: dict[int, list[Any]] = {}
        self._held_bytes = 0
        self._released: deque[tuple[int, int]] = deque()  # (epoch, seq): finalizers, any thread
        self._epoch = 0  # the publisher run's number here: an old run's views free nothing new
        self._proofs: dict[int, bytes] = {}  # receipts of messages above the held ones
        self._last_data = 0.0  # when the last data message arrived
        self._owed = 0  # messages received since the last acknowledgement
        self._owed_bytes = 0
        self._publisher_id: str | None = None
        self.source = Source(address)
        self._last_heard = 0.0
        self._last_hello = 0.0
        self._last_credit = time.monotonic()
        self._last_recv_call = time.monotonic()
        self._waiting_since = self._waiting_logged = time.monotonic()
        self._busy_logged = False  # the "silent but connected" line, once per quiet spell
        self._missing_logged = False  # the "socket file does not exist" line, once per wait
        self._welcome_handshakes = -1  # ClientAuth.handshakes when the last WELCOME came
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if keepalive:
            self._keeper = threading.Thread(
                target=self._keep_alive, name="actbus-keepalive", daemon=True
            )
            self._keeper.start()
        self._hello()

    # ----------------------------------------------------------------- public API
    def recv(self, timeout: float | None = None) -> Batch | Event | None:
        """The next batch or session event, or None if ``timeout`` passes first."""
        self._last_recv_call = time.monotonic()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_publisher()
            if why := self._auth.failure():  # a refused handshake is not a silent publisher
                raise SubscriptionRejected(why)
            try:  # a busy stream has a message waiting: no poll call needed
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if self._held or self._released:
                    self._shm_service()
                wait = (
                    250 if deadline is None else min(250, max(0, deadline - time.monotonic()) * 1e3)
                )
                if not self._sock.poll(int(wait), zmq.POLLIN):
                    if deadline is not None and time.monotonic() >= deadline:
                        return None
                    continue
                frames = self._sock.recv_multipart(copy=False)
            out = self._handle(frames)
            if out is not None:
                return out

    def service(self) -> None:
        """Keep the subscription alive without reading (credit, HELLO after silence,
        a refused handshake raised): what ``recv`` does first, for a ``FanIn`` that
        reads many subscribers' sockets itself."""
        self._last_recv_call = time.monotonic()
        self._check_publisher()
        if why := self._auth.failure():
            raise SubscriptionRejected(why)
        if self._held or self._released:
            self._shm_service()

    def take(self) -> tuple[bool, Batch | Event | None]:
        """One message if one is waiting (never blocks): (whether one was read, what
        it yields; None for a message that yields nothing)."""
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False, None
        return True, self._handle(frames)

    @property
    def socket(self) -> zmq.Socket:
        """The data socket, for polling many subscribers at once (read with ``take``)."""
        return self._sock

    @property
    def publisher_id(self) -> str | None:
        return self._publisher_id

    def request_stats(self) -> None:
        """Ask for the publisher's full counters; they arrive as an ``Event("stats")``."""
        self._send([STATS, pack_map({})])

    def mark(self, request_id: str, sample_index: int = 0, reason: str = "") -> None:
        """Tell every subscriber that ``request_id`` is worth keeping (a probe fired).

        The publisher passes the mark on as an ``Event("mark")``; a sink keeping only
        marked requests persists the ones it still holds in its window.
        """
        self._send(
            [
                MARK,
                pack_map(
                    {"request_id": request_id, "sample_index": sample_index, "reason": reason}
                ),
            ]
        )

    def caught_up(self, beat: dict[str, Any]) -> bool:
        """True when a heartbeat shows nothing sent, pending or queued for us."""
        return (
            int(beat.get("seq", 0)) <= self._next_seq
            and not beat.get("pending")
            and not beat.get("queued")
        )

    def wait_welcome(self, timeout: float, *, every: bool = False) -> dict[str, Any]:
        """Block until the publisher accepted the subscription (or raise); ``every``
        is ``FanIn``'s (here there is one publisher)."""
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
        """Say goodbye and release the sockets. Idempotent."""
        if self._sock.closed:
            return
        if self._held:  # kept batches become private: the publisher reuses their blocks
            self._copy_out(everything=True)
        bye = pack_map({"viewing": self._viewing()})
        self._mapping = None  # the region goes with the last view handed out
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([BYE, bye], zmq.NOBLOCK)
        self._auth.close()
        self._sock.close(linger=100)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _make_socket(self, ident: bytes) -> zmq.Socket:
        """Every socket to the publisher is made here, so they share their options."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, ident)
        sock.setsockopt(zmq.LINGER, 0)
        # Credit holds on arrival: a publisher sending past it is held at its own
        # queue (ours holds recv_queue messages), a frame above our limit closes the
        # connection unread (protocol.frame_limit).
        sock.setsockopt(zmq.RCVHWM, recv_queue(self.subscription.window))
        sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(self.subscription.window_bytes))
        self._auth.apply(sock, watch=ident == self._ident)
        sock.connect(self.address)
        return sock

    def keepalive_socket(self) -> zmq.Socket:
        """A socket of its own for KEEPALIVEs, to be used (``beat``) and closed by the one
        thread that sends them (zmq sockets are not thread-safe)."""
        sock = self._make_socket(uuid.uuid4().bytes)
        sock.setsockopt(zmq.SNDHWM, 4)  # with no publisher, do not pile up stale ones
        return sock

    def beat(self, sock: zmq.Socket) -> None:
        """Tell the publisher we live (on ``keepalive_socket``'s socket), unless the
        consumer has been away longer than ``max_busy_s``."""
        busy = time.monotonic() - self._last_recv_call
        if self.max_busy_s is not None and busy > self.max_busy_s:
            return  # a consumer stuck this long is let go
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([KEEPALIVE, pack_map({"of": self._ident})], zmq.NOBLOCK)

    def _keep_alive(self) -> None:
        """Background thread: tell the publisher we live while the consumer is busy."""
        sock = self.keepalive_socket()
        try:
            while not self._stop.wait(self.beat_s()):
                self.beat(sock)
        finally:
            sock.close(linger=0)

    def beat_s(self) -> float:
        """How often to send a KEEPALIVE: the publisher's heartbeat period."""
        welcome = self.welcome
        return float(welcome.get("heartbeat_s", 0.5)) if welcome else 0.5

    def _send(self, frames: list[bytes]) -> None:
        """Session messages never block: with no publisher they would pile up forever."""
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(frames, zmq.NOBLOCK)

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        hello = self.subscription.to_wire()
        if self._shm:
            # The publisher offers its region if they match, and knows this process
            # by its pid: blocks it may still view outlive a timeout (``leases.py``).
            hello["shm"] = {**host_facts(), "pid": os.getpid()}
            hello["viewing"] = self._viewing()
        self._send([HELLO, pack_map(hello)])

    def _viewing(self) -> list[int] | None:
        """The region messages whose rows are still viewed here (a HELLO's and BYE's
        ``viewing``): the publisher frees the blocks of the others it was holding for
        us. None (more than ``MAX_VIEWING``): it keeps them all."""
        self._collect_released()
        return sorted(self._held) if len(self._held) <= MAX_VIEWING else None

    def _silent(self, now: float) -> bool:
        if self.welcome is None:
            return True
        limit = max(self.silence_s, 8 * float(self.welcome.get("heartbeat_s", 0.5)))
        # Messages already waiting mean the publisher is alive, however long we were away.
        return now - self._last_heard > limit and not self._sock.poll(0)

    def _check_publisher(self) -> None:
        now = time.monotonic()
        silent = self._silent(now)
        if (
            silent
            and self.welcome is not None
            and self._auth.connected
            and self._auth.handshakes == self._welcome_handshakes
        ):
            # Alive (the connection that welcomed us stands) but busy: no new
            # subscription is needed. A reconnection may be a restarted publisher.
            if not self._busy_logged:
                self._busy_logged = True
                log.info(
                    "publisher at %s has sent nothing for %.0fs but is still connected "
                    "(busy: warming up?); waiting",
                    self.address,
                    now - self._last_heard,
                )
            silent = False
        if silent and now - self._last_hello > 1.0:
            if self._held:
                # A new HELLO starts its credit afresh: the publisher may then reuse
                # the blocks of whatever it had sent, so nothing handed out relies on them.
                self._copy_out(everything=True)
            if self.welcome is not None:
                log.warning("publisher at %s went quiet; subscribing again", self.address)
                self.stats.lost += 1
                self.welcome = None
                self._waiting_since = self._waiting_logged = now
            self._hello()
        elif self.welcome is not None and now - self._last_credit > 0.5:
            self._grant()
        if self.welcome is None and now - self._waiting_since >= MISSING_SOCKET_S:
            due = now - self._waiting_logged >= WAITING_LOG_S
            missing = self._missing_socket() if due or not self._missing_logged else None
            if missing is not None and not self._missing_logged:
                self._missing_logged = True
                log.warning(
                    "the socket file %s does not exist: no publisher is bound at %s (not "
                    "started yet, or another path in --connect?); still waiting",
                    missing,
                    self.address,
                )
            elif due:
                self._waiting_logged = now
                log.warning(
                    "no publisher has answered at %s for %.0fs; still waiting, to subscribe "
                    "to %s%s",
                    self.address,
                    now - self._waiting_since,
                    self._wanted(),
                    "" if missing is None else f" (the socket file {missing} does not exist)",
                )

    def _missing_socket(self) -> str | None:
        """The path of an ``ipc://`` address whose socket file does not exist (no
        publisher has bound it), else None; an abstract name (``ipc://@``) has no file."""
        if not self.address.startswith("ipc://") or self.address.startswith("ipc://@"):
            return None
        path = self.address[len("ipc://") :]
        return None if os.path.exists(path) else path

    def _wanted(self) -> str:
        """What this subscription asks for, in a few words (the waiting log)."""
        if self._waiting_for is not None:
            return self._waiting_for
        sub = self.subscription
        if sub.layers == ():
            return "the publisher's counters (no layers)"
        layers = "all layers" if sub.layers is None else f"layers {list(sub.layers)}"
        hooks = "all hooks" if sub.hooks is None else f"hooks {list(sub.hooks)}"
        return f"{layers}, {hooks} (policy {sub.policy}{', as ' + sub.name if sub.name else ''})"

    def _grant(self) -> None:
        # Acknowledges what was read, with the last message's receipt (the publisher
        # frees nothing without it); messages known lost need no acknowledgement.
        seq, proof = self._receipt if self._receipt else (-1, b"")
        if self._held or self._released:
            seq, proof = self._acknowledgeable(seq, proof)
        self._send([CREDIT, pack_map({"acked": seq + 1, "proof": proof})])
        self._owed = 0
        self._owed_bytes = 0
        self._last_credit = time.monotonic()

    def _handle(self, frames: list[zmq.Frame]) -> Batch | Event | None:
        self._last_heard = time.monotonic()
        self._busy_logged = False
        tag = frames[0].bytes if frames else b""
        if tag in (DATA, REGION):
            self._owed += 1
            self._owed_bytes += len(frames[-1].buffer)
            try:
                return self._data(frames)
            except Exception as e:  # a bad message must never end the consumer
                self._reject(e)
                return None
            finally:  # acknowledged even when unreadable, so credit never leaks
                sub = self.subscription
                if self._owed >= max(1, sub.window // 2) or (
                    self._owed_bytes >= sub.window_bytes // 2
                ):
                    self._grant()
        try:
            if len(frames) != 2:
                raise WireError(f"unexpected message shape ({len(frames)} frames)")
            return self._on_session(tag, unpack_map(frames[1].buffer))
        except SubscriptionRejected:
            raise
        except Exception as e:
            self._reject(e)
            return None

    def _reject(self, err: Exception) -> None:
        self.stats.rejected += 1
        n = self.stats.rejected
        field = err.field if isinstance(err, WireError) else type(err).__name__
        by = self.stats.rejected_by
        by[field] = by.get(field, 0) + 1
        # The first of each field, then 1, 2, 4, 8... in all: a flood of bad messages
        # cannot flood the log, and each kind of fault is named once.
        if by[field] == 1 or n & (n - 1) == 0:
            log.warning(
                "rejected a message from the publisher (%d so far, %d for %s): %s",
                n,
                by[field],
                field,
                capped_text(str(err)),
            )

    def _on_session(self, tag: bytes, body: dict[str, Any]) -> Event | None:
        if tag == HEARTBEAT:
            step, seq = int(body.get("step", -1)), int(body.get("seq", 0))
            view = body.get("you") or {}
            if not isinstance(view, dict):
                raise WireError("heartbeat 'you' must be a map")
            self.stats.publisher_step = step
            self.stats.publisher_view = view
            if not body.get("pending"):
                # Nothing waits for us at the publisher, and everything it sent before
                # this heartbeat has arrived: seqs below its counter that we lack were dropped.
                self._skip_to(seq)
            return Event("heartbeat", body, self.source)
        if tag == WELCOME:
            pid, dp_rank = publisher_identity(body)
            next_seq = int(body.get("next_seq", 0))
            new_stream = pid != self._publisher_id
            # Another answer to HELLOs queued while we waited: the same subscription.
            repeat = self.welcome is not None and not new_stream
            if not repeat:
                check_taps(self.address, body, self.subscription.layers, self.subscription.hooks)
            self.welcome = body
            self._missing_logged = False
            # A new stream, or the publisher forgot us (dropped, then let in again) and
            # numbers afresh: it refuses acknowledgements beyond what it sent.
            if new_stream or next_seq < self._next_seq:
                self._publisher_id = pid
                self.source = Source(self.address, pid, dp_rank)
                self._next_seq = next_seq
                self._receipt = None
                # Numbering starts afresh: views of the old run's messages free nothing.
                self._epoch += 1
                self._held.clear()
                self._held_bytes = 0
                self._proofs.clear()
            else:
                self._skip_to(next_seq)
            self._settle_path(body)
            self._auth.settle()  # this WELCOME came over the latest handshake
            self._welcome_handshakes = self._auth.handshakes
            if repeat:
                return None
            self.stats.welcomes += 1
            if new_stream:
                log.info(
                    "subscribed to the publisher at %s (model %s, run %s): %s",
                    self.address,
                    capped(body.get("model")),
                    capped(pid),
                    self._wanted(),
                )
            return Event("welcome", body, self.source)
        if tag == STATS:
            return Event("stats", body, self.source)
        if tag == MARK:
            if not isinstance(body.get("request_id"), str):
                raise WireError("mark without a request_id")
            return Event("mark", body, self.source)
        if tag == END:
            self.welcome = None
            self._waiting_since = self._waiting_logged = time.monotonic()
            return Event("end", body, self.source)
        if tag == REJECT:
            reason = capped_text(str(body.get("reason", "")))
            if "unknown subscriber" in reason:
                # Forgotten (timed out, or not reading): the next WELCOME is a new session.
                if self.welcome is not None:
                    self.stats.evicted += 1
                    n = self.stats.evicted
                    if n & (n - 1) == 0:  # 1, 2, 4...: a publisher cannot flood the log
                        log.warning(
                            "the publisher at %s had dropped this subscriber (it was silent "
                            "or not reading; %d times so far); subscribing again, what was "
                            "sent meanwhile is lost",
                            self.address,
                            n,
                        )
                self.welcome = None
                if self._held:  # their blocks are the publisher's again once we say so
                    self._copy_out(everything=True)
                self._hello()
                return None
            raise SubscriptionRejected(f"publisher at {self.address} refused: {reason}")
        raise WireError(f"unknown message tag {tag[:8]!r}")

    def _acknowledgeable(self, seq: int, proof: bytes) -> tuple[int, bytes]:
        """The newest message below every region message still viewed, and its receipt:
        acknowledging it lets the publisher reuse the blocks of what it covers."""
        self._collect_released()
        if self._held:
            below = min(self._held)
            older = [s for s in self._proofs if s < below]
            if not older:
                return -1, b""  # frees nothing yet: the publisher ignores it
            seq = max(older)
            proof = self._proofs[seq]
        for s in [s for s in self._proofs if s <= seq]:
            del self._proofs[s]
        return seq, proof

    def _collect_released(self) -> None:
        while self._released:
            epoch, released = self._released.popleft()
            gone = self._held.pop(released, None) if epoch == self._epoch else None
            if gone is not None:
                self._held_bytes -= gone[0]

    def _copy_out(self, *, everything: bool = False) -> None:
        """Region batches the consumer keeps hold back the acknowledgement of every
        message after them (it is cumulative): once they hold back half the credit,
        in messages or bytes, copy the oldest into private memory, so their blocks go
        back to the publisher. A view made from a batch's tensor still holds its
        block until it goes (``Subscriber``'s docstring)."""
        self._collect_released()
        sub = self.subscription
        oldest_kept = self._next_seq - max(1, sub.window // 2)  # copy out what is older
        nbytes = self._held_bytes
        for seq in sorted(self._held):
            if not everything and seq > oldest_kept and nbytes < sub.window_bytes // 2:
                break
            entry = self._held[seq]
            nbytes -= entry[0]
            batch = entry[1]()
            if batch is None or entry[2]:
                continue  # only the consumer's own views of it are left
            entry[2] = True
            private = batch.tensor.clone()
            try:
                batch.tensor.set_(private)  # whoever holds this tensor sees the copy
            except RuntimeError:
                batch.tensor = private
            self.stats.copied_out += 1
            # Drops the last reference to the region view unless the consumer made
            # views of its own (then the block stays held until they go).
            del batch, private

    def _shm_service(self) -> None:
        """Nothing waits on the socket: return what the consumer let go (credit), and
        copy out what it keeps once that holds back half the credit, or all of it once
        the stream pauses (``IDLE_COPY_S``: a publisher closing waits for its acks)."""
        if self._held:
            sub = self.subscription
            if time.monotonic() - self._last_data > IDLE_COPY_S:
                self._copy_out(everything=True)
            elif (
                self._next_seq - min(self._held) >= max(1, sub.window // 2)
                or self._held_bytes >= sub.window_bytes // 2
            ):
                self._copy_out()
        if self._released and not self._sock.poll(0):
            self._grant()

    def _skip_to(self, seq: int) -> None:
        if seq > self._next_seq:
            self.stats.missed += seq - self._next_seq
            self._next_seq = seq
            self._grant()

    def _settle_path(self, welcome: dict[str, Any]) -> None:
        """Map the region a WELCOME offers (once per publisher run), or read from the
        socket. A region that cannot be mapped is refused with one warning, and the
        subscription asked again without it (what was sent meanwhile is counted lost)."""
        offer = welcome.get("shm")
        if offer is None or not self._shm:
            self._mapping, self._mapped_for = None, None
            self.stats.path = "socket"
            return
        run = welcome.get("publisher_id")
        if self._mapping is None or self._mapped_for != run:
            try:
                self._mapping = Mapping.attach(offer)
                self._mapped_for = run
            except ShmError as e:
                log.warning(
                    "cannot read the shared memory of the publisher at %s (%s); "
                    "reading from its socket instead",
                    self.address,
                    capped_text(str(e)),
                )
                self._shm = False
                self._mapping, self._mapped_for = None, None
                self.stats.path = "socket"
                self._hello()
                return
        self.stats.path = "shm"

    def _data(self, frames: list[zmq.Frame]) -> Batch:
        """Check the whole message first: a bad one changes no state but ``rejected``."""
        if len(frames) != 4:
            raise WireError(f"data message has {len(frames)} frames, expected 4")
        seq, proof = unpack_seq(frames[1].buffer)
        header = Header.decode(frames[2].buffer)
        if not self.subscription.wants(header.layer, header.hook):
            raise WireError(
                f"layer {header.layer} hook {header.hook!r:.40} was not subscribed to",
                "unsolicited",
            )
        view = None
        if frames[0].bytes == REGION:
            if self._mapping is None:
                raise WireError("a region message, but no region is mapped", "descriptor")
            tensor, view = self._mapping.tensor(frames[3].buffer, header)
        else:
            tensor = frame_to_tensor(frames[3].buffer, header)
        if seq > self._next_seq:
            self.stats.missed += seq - self._next_seq
        self._next_seq = max(self._next_seq, seq + 1)
        if self._receipt is None or seq > self._receipt[0]:
            self._receipt = (seq, proof)
        self.stats.received += 1
        self.stats.bytes_received += header.nbytes
        self.stats.last_step = max(self.stats.last_step, header.step)
        batch = Batch(
            header=header, tensor=tensor, seq=seq, source=self.source, shared=view is not None
        )
        if self._mapping is not None:
            self._proofs[seq] = proof
            if len(self._proofs) > 4 * MAX_WINDOW:  # a publisher numbering without end
                del self._proofs[min(self._proofs)]
        if view is not None:
            self._last_data = time.monotonic()
            self.stats.shm_received += 1
            self._held[seq] = [header.nbytes, weakref.ref(batch), False]
            self._held_bytes += header.nbytes
            # Runs when the last view of these rows goes, in whatever thread drops it.
            weakref.finalize(view, self._released.append, (self._epoch, seq))
            del view
        return batch
