"""Fan-in: one consumer reading several publishers, on ZeroMQ alone.

A ``FanIn`` holds one ``Subscriber`` per publisher, each with its own DEALER socket,
credit window, sequence numbers, receipts and drop accounting, exactly as when it
reads one publisher. Backpressure therefore stays per publisher: under ``block`` a
slow consumer grants credit to each publisher only as it reads that publisher's
messages, so each is slowed, and a publisher that disappears holds no credit of the
others. ``recv`` polls every socket at once (``zmq.Poller``) and takes ready ones
in turn, so no publisher starves another.

A publisher that goes quiet without saying goodbye (killed) is logged by its
subscriber and counted (``lost``); its subscriber keeps saying HELLO, and a publisher
that comes back (a new ``publisher_id``) is taken up again: its batches carry the
new ``Source``. With an endpoints file (``--connect @FILE``) publishers listed later
are subscribed to, and ones removed are let go, while the stream runs.

All of a fan-in's subscribers share one ZeroMQ context (its I/O thread) and one
thread that sends their KEEPALIVEs, so a fan-in costs a few threads whatever the
number of publishers, and about ``FDS_PER_PUBLISHER`` file descriptors per publisher:
a list that would not fit the process's ``RLIMIT_NOFILE`` is refused at start (and an
endpoints file that grows past it is not followed) with an error naming ``ulimit -n``.

Reading a non-loopback tcp publisher without CURVE keys is allowed (the publisher had
to opt in with ``insecure_allow_any_interface``) but logged as INSECURE.

``subscribe`` is the one way every command opens its stream: a single address gets
a plain ``Subscriber`` (the single-publisher path, unchanged), anything else a
``FanIn`` with the same reading interface.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import zmq

from actbus.bus.addresses import is_loopback_address
from actbus.bus.endpoints import MAX_ENDPOINTS, Endpoints, FileWatch
from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch, Event, Subscriber, SubscriberStats
from actbus.errors import ConfigError

log = logging.getLogger("actbus.fanin")
FILE_CHECK_S = 1.0
"""How often an endpoints file is looked at (its mtime; read only when it changed)."""
_SUMMED = ("received", "bytes_received", "missed", "rejected", "welcomes", "lost")
FDS_PER_PUBLISHER = 6
"""File descriptors one publisher's subscriber holds (measured on Linux): the data and
the keepalive sockets' mailboxes and connections, and the socket-event (handshake) pair."""
FDS_RESERVE = 64
"""File descriptors left for the rest of the process (files, logs, the consumer's own)."""


def check_fd_budget(count: int, field_name: str = "--connect") -> None:
    """Refuse ``count`` publishers whose sockets would not fit ``RLIMIT_NOFILE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count * FDS_PER_PUBLISHER + FDS_RESERVE
    most = max(0, (soft - FDS_RESERVE) // FDS_PER_PUBLISHER)
    if soft != resource.RLIM_INFINITY and need > soft:
        raise ConfigError(
            f"{field_name}: {count} publishers need about {need} open files, and this "
            f"process may open {soft} (RLIMIT_NOFILE); raise it (`ulimit -n {need}`) or "
            f"read fewer publishers per consumer (at most {most} here)"
        )


def warn_keyless(addresses: list[str], curve: bool) -> None:
    """One INSECURE line for the non-loopback tcp publishers read without CURVE keys."""
    if curve:
        return
    remote = [a for a in addresses if not is_loopback_address(a)]
    if remote:
        more = f" and {len(remote) - 3} more" if len(remote) > 3 else ""
        log.warning(
            "INSECURE: reading %s%s without CURVE keys: anyone on the network path can read "
            "the stream, and a host that takes an address can feed this consumer; set "
            "server_key and client_secret_key (--server-key, --client-secret-key)",
            ", ".join(remote[:3]),
            more,
        )


class FanIn:
    """Several publishers read as one stream; per-publisher state in ``publishers``."""

    def __init__(
        self,
        endpoints: Endpoints | str,
        subscription: Subscription | None = None,
        **subscriber_kw: Any,
    ) -> None:
        self.endpoints = (
            endpoints if isinstance(endpoints, Endpoints) else Endpoints.parse(endpoints)
        )
        self.address = self.endpoints.describe()
        self.subscription = subscription or Subscription()
        self._kw = {**subscriber_kw, "keepalive": False}
        self._keepalive = subscriber_kw.get("keepalive", True)
        self._curve = subscriber_kw.get("client_secret_key") is not None
        self._ctx = zmq.Context()
        # Every subscriber's data, keepalive and socket-event sockets, in this one context.
        self._ctx.set(zmq.MAX_SOCKETS, 4 * MAX_ENDPOINTS + 64)
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.publishers: dict[str, Subscriber] = {}
        """One subscriber per publisher address, in the order they were listed."""
        self._retired = SubscriberStats()  # counters of publishers let go (file edits)
        self._ended: set[str] = set()
        self._poller = zmq.Poller()
        self._order: list[Subscriber] = []
        self._turn = 0
        self._current: Subscriber | None = None
        self.welcome: dict[str, Any] | None = None
        """The first publisher's WELCOME (model, hidden_size...), as ``Subscriber``'s."""
        self._watch = FileWatch(self.endpoints.file) if self.endpoints.file else None
        self._next_file_check = 0.0
        try:
            first = self._watch.read_now() if self._watch else self.endpoints.current()
            check_fd_budget(len(first))
            self._sync(first)
            if self._watch is not None:
                self._next_file_check = time.monotonic() + FILE_CHECK_S
            if self._keepalive:
                self._keeper = threading.Thread(
                    target=self._keep_alive, name="actbus-fanin-keepalive", daemon=True
                )
                self._keeper.start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ reading
    def recv(self, timeout: float | None = None) -> Batch | Event | None:
        """The next batch or event from any publisher, or None when ``timeout`` passes.

        An ``end`` of one publisher comes as ``Event("left")`` (with its ``source``);
        ``Event("end")`` comes once every publisher has ended (never with a file, whose
        fleet may grow again)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_file()
            for s in self._order:
                s.service()
            n = len(self._order)
            for i in range(n):  # in turn from the one after the last served: no starving
                s = self._order[(self._turn + i) % n]
                got, out = s.take()
                if not got:
                    continue
                self._turn = (self._turn + i + 1) % n
                if out is not None:
                    return self._note(s, out)
                break
            else:
                wait = 250.0
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - time.monotonic()) * 1e3)
                if n == 0:
                    time.sleep(wait / 1e3)
                    ready = False
                else:
                    ready = bool(self._poller.poll(int(wait)))
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    return None

    def _note(self, s: Subscriber, out: Batch | Event) -> Batch | Event | None:
        self._current = s
        if isinstance(out, Batch):
            return out
        if out.kind == "welcome":
            self._ended.discard(s.address)
            if self.welcome is None:
                self.welcome = out.body
            log.info("publisher %s taken up", out.source)
        elif out.kind == "end":
            self._ended.add(s.address)
            log.info("publisher %s ended its stream", out.source)
            if self._watch is None and self._ended >= set(self.publishers):
                return out
            return Event("left", out.body, out.source)
        return out

    def __iter__(self) -> Iterator[Batch]:
        """Batches until every publisher has ended."""
        while True:
            out = self.recv()
            if isinstance(out, Batch):
                yield out
            elif isinstance(out, Event) and out.kind == "end":
                return

    def wait_welcome(self, timeout: float, *, every: bool = False) -> dict[str, Any]:
        """Block until some publisher (``every``: each one listed) accepted the
        subscription, or raise naming those that did not answer. Events read meanwhile
        are not handed on: ``every`` is for a consumer that needs all its publishers
        before anything is routed to it (the front end's return path)."""
        deadline = time.monotonic() + timeout
        while self.welcome is None or (
            every and any(s.welcome is None for s in self.publishers.values())
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                silent = [a for a, s in self.publishers.items() if s.welcome is None]
                raise TimeoutError(
                    f"no publisher answered at {', '.join(silent)} within {timeout}s"
                )
            self.recv(timeout=left)
        return self.welcome

    def caught_up(self, beat: dict[str, Any]) -> bool:
        """Whether the publisher whose heartbeat was just read has nothing in flight."""
        return self._current is not None and self._current.caught_up(beat)

    def request_stats(self) -> None:
        for s in self._order:
            s.request_stats()

    def mark(self, request_id: str, sample_index: int = 0, reason: str = "") -> None:
        """Marks go to every publisher: a request id is known to one of them only."""
        for s in self._order:
            s.mark(request_id, sample_index, reason)

    # -------------------------------------------------------------------- stats
    @property
    def stats(self) -> SubscriberStats:
        """The counters summed over publishers (``per_publisher`` has each)."""
        out = SubscriberStats()
        subs = [*self._order]
        for name in _SUMMED:
            total = getattr(self._retired, name) + sum(getattr(s.stats, name) for s in subs)
            setattr(out, name, total)
        out.rejected_by = dict(self._retired.rejected_by)
        for s in subs:
            for k, v in s.stats.rejected_by.items():
                out.rejected_by[k] = out.rejected_by.get(k, 0) + v
        out.last_step = max((s.stats.last_step for s in subs), default=-1)
        return out

    def per_publisher(self) -> dict[str, dict[str, Any]]:
        """Each publisher's own counters, by address: what it sent us, what it dropped
        for us (``missed``, and its own view), whether it is there now."""
        out = {}
        for addr, s in self.publishers.items():
            st = s.stats
            row = {f.name: getattr(st, f.name) for f in fields(st) if f.name != "publisher_view"}
            row["publisher_id"] = s.publisher_id
            row["dp_rank"] = s.source.dp_rank
            row["connected"] = s.welcome is not None
            row["ended"] = addr in self._ended
            dropped = st.publisher_view.get("dropped", {})
            row["publisher_dropped"] = (
                sum(dropped.values()) if isinstance(dropped, dict) else dropped
            )
            out[addr] = row
        return out

    # --------------------------------------------------------------- membership
    def _check_file(self) -> None:
        if self._watch is None or time.monotonic() < self._next_file_check:
            return
        self._next_file_check = time.monotonic() + FILE_CHECK_S
        if self._watch.changed():
            try:
                check_fd_budget(len(self._watch.addresses), f"--connect=@{self._watch.path}")
            except ConfigError as e:
                log.warning("%s; keeping the %d publishers read now", e, len(self.publishers))
                return
            self._sync(self._watch.addresses)

    def _sync(self, addresses: list[str]) -> None:
        """Subscribe to publishers newly listed; let go of those no longer listed."""
        for addr in [a for a in self.publishers if a not in addresses]:
            s = self.publishers.pop(addr)
            self._poller.unregister(s.socket)
            for name in _SUMMED:
                setattr(self._retired, name, getattr(self._retired, name) + getattr(s.stats, name))
            for k, v in s.stats.rejected_by.items():
                self._retired.rejected_by[k] = self._retired.rejected_by.get(k, 0) + v
            self._ended.discard(addr)
            s.close()
            log.info("publisher %s no longer listed: unsubscribed", addr)
        warn_keyless([a for a in addresses if a not in self.publishers], self._curve)
        for addr in addresses:
            if addr not in self.publishers:
                s = Subscriber(addr, self.subscription, context=self._ctx, **self._kw)
                self.publishers[addr] = s
                self._poller.register(s.socket, zmq.POLLIN)
                if self._watch is not None or self._order:
                    log.info("publisher %s listed: subscribing", addr)
        self._order = list(self.publishers.values())
        if self._current not in self._order:
            self._current = None

    def _keep_alive(self) -> None:
        """One thread for every subscriber's KEEPALIVEs (see ``Subscriber``): each gets a
        socket of its own here, made, used and closed on this thread only."""
        socks: dict[Subscriber, zmq.Socket] = {}
        try:
            while True:
                subs = list(self._order)  # replaced, never changed in place: a snapshot
                if self._stop.wait(min((s.beat_s() for s in subs), default=0.5)):
                    return
                for s in [s for s in socks if s not in subs]:
                    socks.pop(s).close(linger=0)
                for s in subs:
                    if s not in socks:
                        socks[s] = s.keepalive_socket()
                    s.beat(socks[s])
        finally:
            for sock in socks.values():
                sock.close(linger=0)

    def close(self) -> None:
        """Say goodbye to every publisher. Idempotent."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        for s in self.publishers.values():
            with contextlib.suppress(Exception):
                s.close()
        if not self._ctx.closed:  # any socket a failed close left open is closed here
            self._ctx.destroy(linger=0)

    def __enter__(self) -> FanIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subscribe(
    connect: str | Endpoints, subscription: Subscription | None = None, **kw: Any
) -> Subscriber | FanIn:
    """The stream ``--connect`` names: a ``Subscriber`` for one address (the
    single-publisher path, unchanged), a ``FanIn`` for several or a file."""
    endpoints = connect if isinstance(connect, Endpoints) else Endpoints.parse(connect)
    if not endpoints.fan_in:
        warn_keyless(list(endpoints.addresses), kw.get("client_secret_key") is not None)
        return Subscriber(endpoints.addresses[0], subscription, **kw)
    return FanIn(endpoints, subscription, **kw)


def per_publisher(sub: Subscriber | FanIn) -> dict[str, dict[str, Any]]:
    """Counters by publisher, for either kind (one entry for a ``Subscriber``)."""
    if isinstance(sub, FanIn):
        return sub.per_publisher()
    st = sub.stats
    row = {f.name: getattr(st, f.name) for f in fields(st) if f.name != "publisher_view"}
    row["publisher_id"] = sub.publisher_id
    row["dp_rank"] = sub.source.dp_rank
    return {sub.address: row}
