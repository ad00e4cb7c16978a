"""What the front end's collectors of returned rows and returned scores share.

Each is one lossless subscriber of the front end's own (per set of publishers: those
of the data-parallel ranks it serves), read by a thread that files what arrives per
request; vLLM's output processing takes it per output. This module holds their common
life: subscribing and waiting for the publishers' welcome, the receiving thread,
forgetting requests nobody collects, the bounded wait of a final output, closing, and
the registry each kind keeps (collector per set of publishers, collector per request
id: vLLM's own, unique where callers' ids repeat). What they collect is kept in
``actbus.rowstore``.

The final output's wait runs inside vLLM's output processing, which every other
request's outputs wait on, so it is kept short: it happens only when a request's last
rows are still on their way, and gives up once nothing has arrived for
``STALL_S`` (a collector that is catching up keeps waiting, up to ``RETURN_TIMEOUT_S``;
one whose publisher went quiet does not hold every other request up for that long).
``stats()`` counts the waits and their time; a wait over ``SLOW_WAIT_S`` is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from actbus.bus.addresses import connectable
from actbus.bus.endpoints import Endpoints
from actbus.bus.fanin import subscribe
from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch
from actbus.errors import ConfigError

log = logging.getLogger("actbus.collector")
C = TypeVar("C", bound="Collector")
RETURN_TIMEOUT_S = 30.0
"""The longest a final output waits for its request's last rows,"""
STALL_S = 5.0
"""and the longest it waits while nothing arrives at all."""
SLOW_WAIT_S = 0.5
"""A final output's wait longer than this is logged."""
FORGET_AFTER_S = 120.0
"""An ended request nobody collected (aborted offline, client gone) is forgotten after this,"""
FORGET_UNENDED_S = 24 * 3600.0
"""and one that never reached the engine (so no end ever comes) after this."""


class Registry:
    """The collectors of one kind in this process: one per set of publishers, and the
    one holding each request id's data (for the output processor's wrapper)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.collectors: dict[str, Collector] = {}
        self.owner: dict[str, Collector] = {}

    def get(self, addresses: list[str], make: Callable[[list[str]], Collector]) -> Collector:
        key = ",".join(addresses)
        with self.lock:
            if key not in self.collectors:
                self.collectors[key] = make(addresses)
            return self.collectors[key]

    def collector_for(self, request_id: str) -> Any:
        """The collector holding this request id's data (None: no collector does)."""
        return self.owner.get(request_id)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the data of requests whose caller went away (an abort)."""
        owners = (self.owner.get(r) for r in request_ids)
        for col in {id(c): c for c in owners if c is not None}.values():
            col.forget(request_ids)

    def close(self, addresses: list[str]) -> int:
        """Close the collectors that read any of these publishers, whose engine stopped:
        their subscribers would otherwise wait for it, and say so every few seconds,
        for as long as the process lives. Returns how many were closed."""
        gone = {connectable(a) for a in addresses}
        with self.lock:
            keys = [k for k in self.collectors if gone.intersection(k.split(","))]
            closing = [self.collectors.pop(k) for k in keys]
        for col in closing:
            for caller in [c for c, owner in list(self.owner.items()) if owner is col]:
                self.owner.pop(caller, None)
            col.close()
        return len(closing)


class Collector:
    """A front end's subscriber whose thread files each message per request.

    Subclasses say what they subscribe to (``subscription``), file a message
    (``_add``, under ``_cond``), and which of their pending requests nobody will
    collect (``_stale``, ``_drop``). ``_pending`` maps (request id, sample) to a
    subclass's per-request record, which has ``created`` and ``ended_at`` (None or 0.0
    until the request's end came)."""

    where: ClassVar[str] = "extra_args.actbus"
    """The request field named in errors."""
    thread_name: ClassVar[str] = "actbus-collector"
    what: ClassVar[str] = "rows"
    """What it collects, in log lines."""
    instead: ClassVar[str] = "subscribe to the bus instead"
    """What a caller whose publishers it cannot reach can do instead, in errors."""
    registry: ClassVar[Registry]
    """This kind's collectors: each concrete kind sets its own."""

    def __init__(self, addresses: str | list[str]) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.address = ",".join(addresses)
        self._pending: dict[tuple[str, int], Any] = {}
        self._cond = threading.Condition()
        self._sub = subscribe(
            Endpoints(self.address, tuple(addresses)), self.subscription(), keepalive=False
        )
        try:  # data routed before the subscription is in place would never come
            self._sub.wait_welcome(RETURN_TIMEOUT_S, every=True)
        except (TimeoutError, RuntimeError) as e:
            self._sub.close()
            raise ConfigError(
                f"{self.where}: the publisher at {self.address} did not answer ({e})"
            ) from None
        self._forgot_at = time.monotonic()
        self._received_at = time.monotonic()
        self._waits = [0, 0.0, 0.0, 0]  # final outputs that waited, seconds, longest, gave up
        self._cpu_s = 0.0  # the receiving thread's CPU time, as of its last message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def subscription(self) -> Subscription:
        raise NotImplementedError

    @classmethod
    def refuse(cls, cfg: Any, dp: Any, hint: str) -> list[str]:
        """The publishers this front end's collector reads (those of the data-parallel
        ranks ``dp`` serves; default: rank 0), or a ConfigError for those it cannot
        reach; ``hint`` says what to do instead."""
        if cfg.server_secret_key:
            raise ConfigError(
                f"{cls.where}: the publisher uses CURVE keys, which the front end does "
                f"not hold; use an ipc:// or loopback publish address, or {hint}"
            )
        if dp is not None and dp.remote:
            raise ConfigError(
                f"{cls.where}: this front end sends requests to data-parallel ranks "
                f"{list(dp.remote)} on other nodes, whose publishers it cannot reach; run "
                "each node's ranks behind a front end of its own "
                f"(--data-parallel-hybrid-lb or external load balancing), or {hint}"
            )
        return [connectable(cfg.publish_address(r)) for r in (dp.served if dp else (0,))]

    @classmethod
    def for_config(cls: type[C], cfg: Any, dp: Any = None) -> C:
        """One per set of publishers in this process: those of the data-parallel ranks
        this front end sends requests to (``dp``; default: rank 0 alone); refuses what
        it cannot reach."""
        return cls.registry.get(cls.refuse(cfg, dp, cls.instead), cls)  # type: ignore[return-value]

    # ------------------------------------------------------------- front end side
    def pending(self) -> int:
        """Samples registered and not collected or forgotten yet."""
        with self._cond:
            return len(self._pending)

    def forget(self, request_ids: list[str]) -> None:
        """Drop these requests' data: their caller went away."""
        ids = set(request_ids)
        with self._cond:
            for key in [k for k in self._pending if k[0] in ids]:
                self._drop(key)
            for c in ids:
                self._disown_if_done(c)

    def _own(self, request_id: str) -> None:
        self.registry.owner[request_id] = self

    def _disown_if_done(self, request_id: str) -> None:
        """Under ``_cond``: a request id none of whose samples is pending is let go."""
        owner = self.registry.owner
        if owner.get(request_id) is self and not any(k[0] == request_id for k in self._pending):
            owner.pop(request_id, None)

    def _wait_final(self, arrived: Callable[[], bool], bound: float) -> bool:
        """Under ``_cond``: wait (at most ``bound`` s, and while data keeps arriving)
        until ``arrived()``; returns it. Counted and, when long, logged."""
        ok = arrived()
        if ok or bound <= 0:  # nothing to wait for, or an abort: nobody waits
            return ok
        t0 = time.monotonic()
        deadline = t0 + bound
        while True:
            now = time.monotonic()
            quiet = now - max(self._received_at, t0)
            if now >= deadline or quiet >= STALL_S:
                break
            self._cond.wait(min(deadline - now, STALL_S - quiet, 0.5))
            if arrived():
                ok = True
                break
        self._count_wait(time.monotonic() - t0, ok)
        return ok

    def _count_wait(self, waited: float, ok: bool) -> None:
        """Under ``_cond``: a final output's wait, counted and, when long, logged."""
        w = self._waits
        w[0], w[1], w[2], w[3] = w[0] + 1, w[1] + waited, max(w[2], waited), w[3] + (not ok)
        if waited > SLOW_WAIT_S:
            log.warning(
                "actbus: a final output waited %.2f s for its request's last %s (%s)",
                waited, self.what, "they came" if ok else "gave up",
            )  # fmt: skip

    def stats(self) -> dict[str, float]:
        """Final outputs that had to wait for their last data, the seconds waited in
        all and at most, and those that gave up waiting; and the receiving thread's CPU
        seconds (it shares the GIL with vLLM's output processing)."""
        with self._cond:
            n, total, longest, gave_up = self._waits
        return {
            "final_waits": n,
            "final_wait_s": round(total, 6),
            "final_wait_max_s": round(longest, 6),
            "final_gave_up": gave_up,
            "recv_cpu_s": round(self._cpu_s, 6),
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close()

    # ------------------------------------------------------------- receiving side
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = self._sub.recv(timeout=0.5)
            except Exception:  # keep collecting; a request that misses data says so
                log.exception("actbus: %s subscriber failed; retrying", self.thread_name)
                time.sleep(0.5)
                continue
            if isinstance(out, Batch):
                try:
                    self._add(out)
                except Exception:  # a message that does not add up costs only itself
                    log.exception("actbus: %s: a message was not filed", self.thread_name)
                self._received_at = time.monotonic()
                self._cpu_s = time.thread_time()
            self._forget_stale()

    def _add(self, b: Batch) -> None:
        raise NotImplementedError

    def _forget_stale(self) -> None:
        """Every second: forget the requests nobody will collect."""
        now = time.monotonic()
        if now - self._forgot_at < 1.0:
            return
        self._forgot_at = now
        with self._cond:
            stale = [
                k
                for k, p in self._pending.items()
                if (p.ended_at and now - p.ended_at > FORGET_AFTER_S and not _streamed(p))
                or now - p.created > FORGET_UNENDED_S
            ]
            for key in stale:
                self._drop(key)
            for request_id in {k[0] for k in stale}:
                self._disown_if_done(request_id)
            self._housekeep(bool(stale))

    def _drop(self, key: tuple[str, int]) -> None:
        """Under ``_cond``: let a pending request go (collected or forgotten)."""
        del self._pending[key]

    def _housekeep(self, dropped: bool) -> None:
        """Under ``_cond``, every second, after stale requests were dropped."""


def _streamed(p: Any) -> bool:
    """Rows its SSE chunks take (``chunked``): its stream lets it go when it ends, however
    slowly its client reads, so it is not forgotten once ended."""
    return bool(getattr(p, "chunked", False))
