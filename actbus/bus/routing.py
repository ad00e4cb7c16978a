"""Routing: which subscriber gets each message, when it goes out, and what is counted.

Socket-free: the publisher injects ``send`` (it gets one subscriber's frames and
says whether they went) and runs everything here on its own thread, except
``Router.admit``, which the engine thread calls. So routing is tested without
sockets, threads or sleeps.

A subscriber gets the messages of the layers and hooks it asked for, cut down to
the requests its ``match`` filter keeps (a copy, made once per distinct filter;
unfiltered subscribers get the captured buffer itself). Subscribers that name the
same ``group`` share one copy of the stream: each message goes to exactly one
member, the least loaded one with credit.

What happens when a subscriber has no credit is its policy's (``policies.py``):
a message that does not fit in its memory queue (``PENDING_LIMIT`` beyond its
credit) goes to the policy's ``on_full``; a lossless policy's ``holds`` makes the
shared queue wait instead (``Router.can_take``).

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import tempfile
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actbus.bus.accounting import LatencyWindow, SubCounters
from actbus.bus.outlet import Admission, TapOffer
from actbus.bus.policies import Clock, Policy, policy_of
from actbus.bus.protocol import Subscription, frame_limit
from actbus.bus.spill import SpillLog, SpillRoot, sweep
from actbus.wire import (
    DATA,
    PROOF_BYTES,
    REGION,
    Header,
    RowIndex,
    WireError,
    pack_seq,
    tensor_to_frame,
)

log = logging.getLogger("actbus.publisher")

# How many messages a subscriber may have waiting beyond its credit before its
# policy applies (block: hold the shared queue; drop_newest: drop; spill: to disk).
PENDING_LIMIT = 8

Send = Callable[[list[Any]], bool]
"""Sends one data message's frames (``[ident, DATA, seq, header, payload]``); False:
the subscriber is gone (the sender has already dealt with it)."""
Share = Callable[["Item"], "tuple[bytes, torch.Tensor] | None"]
"""A message's rows in the publisher's shared-memory region: its descriptor frame and
the region tensor that holds them (held until acknowledged); None: no room now, and
the message goes over the socket."""


@dataclass
class Item:
    """One message on its way: the publisher's queue entry, or a filtered copy."""

    header: Header
    tensor: torch.Tensor | None  # keeps the payload alive until sent; None: dropped at source
    nbytes: int
    ready: Any = None  # an event to wait on before the tensor and row index are readable
    t_published: float = 0.0
    header_bytes: bytes = b""
    payload: memoryview | None = None
    # A filtered copy: the message it was cut from. Weak: the message keeps its cuts
    # (``variants``), and a cycle would keep its rows' region block past its use.
    root: weakref.ref[Item] | None = None
    sent_once: bool = False
    variants: dict[str, Item | None] | None = None  # per match filter, made once
    counted: tuple[Route, ...] = ()  # subscribers whose queued_in counts it
    left_queue: bool = False  # taken from the publisher's queue (routed or dropped)
    shared: tuple[bytes, torch.Tensor] | None = None  # its rows in the shared region

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

    def unpin(self) -> None:
        """Hold the payload (and the row index's token ids) in ordinary memory, not
        the pinned staging block they were copied into: see ``Publisher``'s backlog.
        The copy needs no GIL (torch lets it go)."""
        if self.tensor is None:
            return
        self.tensor = torch.empty(self.tensor.shape, dtype=self.tensor.dtype).copy_(self.tensor)
        if self.payload is not None:
            self.payload = tensor_to_frame(self.tensor)
        rows = self.header.rows
        if rows.token_ids.base is not None:  # a view of the step's pinned token ids
            rows.token_ids = rows.token_ids.copy()

    @property
    def wire_bytes(self) -> int:
        return len(self.header_bytes) + self.nbytes


class Route:
    """One subscriber's routing state: its queue, credit, spill and counters."""

    def __init__(
        self,
        ident: bytes,
        sub: Subscription,
        policy: Policy,
        *,
        send: Send,
        latency: LatencyWindow,
        spill_dir: Callable[[], Path],
        last_seen: float = 0.0,
        acked_step: int = -1,
        serial: int = 0,
    ) -> None:
        self.ident = ident
        self.serial = serial  # unique per publisher: stats key it, never the identity
        self.stats_answered = -math.inf  # when its last STATS request was answered
        self.last_seen = last_seen
        self.acked_step = acked_step  # the newest acknowledged message's step (lag is from it)
        self.pending: deque[tuple[int, Item]] = deque()
        self.next_seq = 0  # the seq the next routed message gets
        self._proof_key = os.urandom(16)  # receipts are keyed per route: not guessable
        self.inflight: deque[tuple[int, int, int]] = deque()  # seq, nbytes, step
        # The region blocks a local subscriber reads its messages from, by seq: held
        # until acknowledged (a block is reused only once nothing refers to it).
        self.reading: deque[tuple[int, torch.Tensor]] = deque()
        self.share: Share | None = None  # set: the shared-memory path (a local subscriber)
        self.pidfd: int | None = None  # its process, on the shared-memory path (leases.py)
        self.shm_fallback = 0  # messages it got over the socket: no room in the region
        self.inflight_bytes = 0
        self.spill: SpillLog | None = None
        self.spiller: Policy | None = None  # whose overflow ``spill`` holds (it decides)
        self.c = SubCounters()
        # Messages published for it and not yet routed (each side written by one thread).
        self.queued_in = 0  # by publishers, under the queue lock
        self.queued_out = 0  # by the publisher thread
        self.sampled_at_source = 0  # by the engine thread: steps skipped in admit
        self._send = send
        self._latency = latency
        self._spill_dir = spill_dir
        self.sub = sub
        self.policy = policy
        self.unit = ""  # whom admission counts room for: itself, or its group
        self.variant_key: str | None = None  # its match filter's key; None: unfiltered
        self._subscribe(sub, policy)

    def _subscribe(self, sub: Subscription, policy: Policy) -> None:
        self.sub, self.policy = sub, policy
        self.max_frame = frame_limit(sub.window_bytes)  # what its socket accepts
        self.unit = f"g:{sub.group}" if sub.group else self.ident.hex()
        self.variant_key = (
            repr((sorted((sub.match or {}).items()), sub.returned_only))
            if sub.filters_requests
            else None
        )

    def resubscribe(self, sub: Subscription, policy: Policy, now: float) -> None:
        """The same subscriber said HELLO again (it thought the publisher went quiet):
        keep its queue and numbering, so nothing is lost or renumbered; its credit
        starts afresh. A policy that did not change keeps its state. The region blocks
        of what it was sent stay held (``reading``) until it acknowledges them in that
        numbering: some may still be on their way to it, or viewed."""
        self._subscribe(sub, self.policy if dict(policy) == dict(self.policy) else policy)
        self.last_seen = now
        self.inflight.clear()
        self.inflight_bytes = 0

    # -------------------------------------------------------------- accounting
    @property
    def spilled_now(self) -> int:
        return len(self.spill) if self.spill is not None else 0

    @property
    def queued(self) -> int:
        """Routed to it, not yet sent: in memory or on disk."""
        return len(self.pending) + self.spilled_now

    @property
    def ahead(self) -> int:
        """Messages published for it (or its group) and not routed yet."""
        return self.queued_in - self.queued_out

    @property
    def next_unsent(self) -> int:
        """The seq of the oldest message not yet sent (WELCOME tells it)."""
        if self.pending:
            return self.pending[0][0]
        if self.spill:
            return self.spill.head().seq
        return self.next_seq

    @property
    def backed_up(self) -> bool:
        """Its memory queue is full."""
        return len(self.pending) >= PENDING_LIMIT

    def may_send(self, nbytes: int) -> bool:
        """Within both credits; an oversized message goes alone when nothing is in flight."""
        if not self.inflight:
            return True
        return (
            len(self.inflight) < self.sub.window
            and self.inflight_bytes + nbytes <= self.sub.window_bytes
        )

    def full(self, nbytes: int) -> bool:
        """A new message cannot join ``pending``: spill is in use (order) or no room."""
        return bool(self.spill) or (
            len(self.pending) >= PENDING_LIMIT and not self.may_send(nbytes)
        )

    def room(self, nbytes: int) -> int:
        """Messages of ``nbytes`` it takes before one does not fit: free pending slots
        and credit (0 while anything is spilled: nothing overtakes it)."""
        if self.spill:
            return 0
        credit = max(0, self.sub.window - len(self.inflight))
        if nbytes:
            credit = min(credit, max(0, self.sub.window_bytes - self.inflight_bytes) // nbytes)
        return max(0, PENDING_LIMIT - len(self.pending)) + credit

    def proof(self, seq: int) -> bytes:
        """The receipt of message ``seq``: only a peer that read it knows it."""
        h = hashlib.blake2b(seq.to_bytes(8, "little"), key=self._proof_key, digest_size=PROOF_BYTES)
        return h.digest()

    def ack(self, acked: int, proof: bytes | None = None) -> None:
        """Everything below seq ``acked`` was received; ``proof`` is message
        ``acked - 1``'s receipt, as its sequence frame carried it.

        An acknowledgement beyond the numbers given out so far, or one that would
        free messages without the receipt of the last, is refused (``WireError``)
        and changes nothing: it would free credit for messages never read, and a
        peer that never reads would make the publisher queue without end.
        """
        if acked > self.next_seq:
            raise WireError(
                f"CREDIT acked={acked} is beyond the messages sent (the next is seq "
                f"{self.next_seq}); acknowledge only what arrived"
            )
        reading = self.reading  # what it no longer reads (only it can lose by lying)
        while reading and reading[0][0] < acked:
            reading.popleft()
        if not self.inflight or self.inflight[0][0] >= acked:
            return  # frees nothing: no receipt needed
        if proof != self.proof(acked - 1):
            raise WireError(
                f"CREDIT proof for acked={acked} is not message {acked - 1}'s receipt; "
                "acknowledge only messages read, with the proof their sequence frame carried"
            )
        while self.inflight and self.inflight[0][0] < acked:
            _, nbytes, step = self.inflight.popleft()
            self.inflight_bytes -= nbytes
            self.acked_step = max(self.acked_step, step)

    def wants(self, layer: int, hook: str, for_return: bool) -> bool:
        """Whether a message of this tap can hold anything for it; the front end's
        return subscriber only wants messages with returned rows or request ends."""
        return self.sub.wants(layer, hook) and (for_return or not self.sub.returned_only)

    def spill_log(self, owner: Policy) -> SpillLog:
        """Its spill, opened on first use by the spill policy ``owner``."""
        if self.spill is None:
            self.spill = SpillLog(self._spill_dir() / self.ident.hex())
        self.spiller = owner
        return self.spill

    # ----------------------------------------------------------------- routing
    def take(self, item: Item) -> bool:
        """Route ``item`` to this subscriber; True if that was a drop at the source."""
        c = self.c
        if self.policy.skips(item.header.step):
            c.sampled_out += 1  # not wanted: neither a drop nor a gap
            return False
        if item.tensor is None:  # dropped at the source (admit): a counted gap
            c.routed += 1
            self.next_seq += 1
            c.dropped["source"] += 1
            return True
        m = item if self.variant_key is None else _variant(item, self.sub, self.variant_key)
        if m is None:
            c.filtered_out += 1  # no rows for its match filter: not a gap either
            return False
        c.routed += 1
        seq = self.next_seq
        self.next_seq = seq + 1
        if self.full(m.nbytes):
            # Nothing overtakes what is spilled: the spill's owner decides while it holds any.
            policy = self.spiller if self.spill else self.policy
            if not policy.on_full(self, seq, m):  # type: ignore[union-attr]
                return False
        self.pending.append((seq, m))
        self.flush()
        return False

    def flush(self) -> None:
        """Send what its credit allows: memory first, then what was spilled."""
        pending = self.pending
        while True:
            from_spill = not pending
            if pending:
                seq, m = pending[0]
                nbytes, step = m.nbytes, m.header.step
                if not self.may_send(nbytes):
                    return
                held = None
                if self.share is not None and nbytes:
                    shared = self.share(m)
                    if shared is None:
                        self.shm_fallback += 1
                    else:
                        desc, held = shared
                        frames = [self.ident, REGION, pack_seq(seq, self.proof(seq))]
                        frames += [m.header_bytes, desc]
                if held is None:
                    if self._oversized(nbytes):
                        pending.popleft()
                        continue
                    frames = [
                        self.ident,
                        DATA,
                        pack_seq(seq, self.proof(seq)),
                        m.header_bytes,
                        m.payload,
                    ]
            elif self.spill:
                rec = self.spill.head()
                nbytes, step, seq = rec.payload_len, rec.step, rec.seq
                if not self.may_send(nbytes):
                    return
                if self._oversized(nbytes):
                    self.spill.discard()
                    continue
                try:
                    header_bytes, payload = self.spill.read_head()
                except OSError as e:
                    log.error("actbus: spill read for %s failed (%s)", self.sub.name, e)
                    self.spill.discard()
                    self.c.dropped["spill_error"] += 1
                    continue
                frames = [self.ident, DATA, pack_seq(seq, self.proof(seq)), header_bytes, payload]
                held = None
            else:
                return
            if not self._send(frames):
                return
            if from_spill:
                self.spill.discard()  # type: ignore[union-attr]
                self.c.replayed += 1
            else:
                root = m.root() if m.root is not None else m
                if root is not None and not root.sent_once:
                    root.sent_once = True
                    self._latency.add(time.monotonic() - root.t_published)
                pending.popleft()
            self.inflight.append((seq, nbytes, step))
            if held is not None:
                self.reading.append((seq, held))
            self.inflight_bytes += nbytes
            self.c.sent += 1
            self.c.bytes_sent += nbytes

    def _oversized(self, nbytes: int) -> bool:
        """A message above what its socket accepts (``frame_limit``: sent, it would
        only close the connection) is dropped and counted, never sent; the first
        warned about, naming the fix."""
        if nbytes <= self.max_frame:
            return False
        if not self.c.dropped["oversized"]:
            log.warning(
                "actbus: a %d-byte message is above what subscriber %r accepts on its "
                "socket (%d bytes: its window_bytes); dropped and counted as oversized: "
                "give it a larger --window-mb",
                nbytes,
                self.sub.name[:64],
                self.max_frame,
            )
        self.c.dropped["oversized"] += 1
        return True

    def close(self, reason: str) -> int:
        """It is gone: what waited for it is dropped (counted under ``reason``), its
        spill deleted. Returns how many were unacknowledged."""
        lost = self.queued
        if lost:
            self.c.dropped[reason] += lost
        self.pending.clear()
        if self.spill is not None:
            self.spill.close()
        self.reading.clear()  # its region blocks are free once nobody else reads them
        return len(self.inflight)

    def stats(self, last_step: int) -> dict[str, Any]:
        """Its counters and queue state (``accounting.py`` says what adds up)."""
        backlog = bool(self.queued or self.inflight)
        return {
            "name": self.sub.name,
            "policy": str(self.policy),
            "group": self.sub.group,
            "path": "shm" if self.share is not None else "socket",
            "shm_fallback": self.shm_fallback,
            **self.c.as_dict(),
            "sampled_out": self.c.sampled_out + self.sampled_at_source,
            "pending": len(self.pending),
            "spill_depth": self.spilled_now,
            "spill_bytes": self.spill.nbytes if self.spill is not None else 0,
            "spill_peak_bytes": self.spill.peak_bytes if self.spill is not None else 0,
            "queue_depth": self.queued,
            "inflight": len(self.inflight),
            "inflight_bytes": self.inflight_bytes,
            "lag_steps": max(0, last_step - self.acked_step) if backlog else 0,
        }


def _variant(item: Item, sub: Subscription, key: str) -> Item | None:
    """``item`` cut down to the requests ``sub``'s match filter keeps (None: nothing
    for it). Made once per distinct filter (``key``) and message."""
    if item.variants is None:
        item.variants = {}
    elif key in item.variants:
        return item.variants[key]
    rows = item.header.rows
    keep = _kept(rows, sub, key)
    variant: Item | None
    if len(keep) == len(rows.request_ids):
        variant = item
    elif not keep and not item.header.ended:
        variant = None  # a message with no rows only matters for its request ends
    else:
        assert item.tensor is not None  # a source drop is never cut
        sub_rows, idx = rows.select(keep)
        tensor = item.tensor[torch.from_numpy(idx)].contiguous()
        header = dataclasses.replace(
            item.header, rows=sub_rows, shape=(len(idx), *item.header.shape[1:])
        )
        variant = Item(
            header, tensor, header.nbytes, t_published=item.t_published, root=weakref.ref(item)
        )
        variant.materialize()
    item.variants[key] = variant
    return variant


def _kept(rows: RowIndex, sub: Subscription, key: str) -> list[int]:
    """The requests of ``rows`` that ``sub``'s filter keeps. A step's messages share
    one row index (every layer of a capture group, every layer of a monitor), so it
    is worked out once per index and filter: this runs on the publisher's thread,
    which shares the GIL with the engine's."""
    cuts = rows.cuts
    if key in cuts:
        return cuts[key]
    if sub.match:
        keep = [
            i
            for i in range(len(rows.request_ids))
            if sub.wants_request(rows.request_tags(i), rows.request_returned(i))
        ]
    elif sub.returned_only:  # no per-request call
        keep = [i for i, r in enumerate(rows.returned) if r]
    else:
        keep = list(range(len(rows.request_ids)))
    cuts[key] = keep
    return keep


class Router:
    """Every subscriber's ``Route``, and the decisions that span them: admission,
    whether the shared queue may move on, group load balancing.

    ``routes`` is changed by the publisher thread under the publisher's lock;
    ``snapshot`` is the tuple the engine thread reads without one.
    """

    def __init__(
        self,
        send: Send,
        *,
        spill_dir: str | Path | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """``spill_dir``: where spill directories are made (None: the system temp
        dir); ``clock``: what rate samplers read (tests step it by hand)."""
        self._send = send
        self._clock = clock
        self._spill_parent = spill_dir
        self._spill_root: SpillRoot | None = None
        self.routes: dict[bytes, Route] = {}
        self.snapshot: tuple[Route, ...] = ()
        # Per snapshot: the subscribers that want each (layer, hook), so what a message
        # costs grows with those that want it, not with every subscriber connected.
        self._wanting: tuple[tuple[Route, ...], dict[tuple[int, str], tuple[Route, ...]]] = (
            (),
            {},
        )
        self.latency = LatencyWindow()
        self.counters: Counter[str] = Counter()  # publisher thread
        # What publishers killed before this one left (its own is made when first used).
        self.counters["stale_spills_removed"] = sweep(
            Path(spill_dir if spill_dir is not None else tempfile.gettempdir())
        )
        self.engine_counts: Counter[str] = Counter()  # engine thread only
        self.routed_step = -1  # by the publisher thread
        self.joined = 0  # subscribers ever added: the next one's serial
        self.skipped_step = -1  # by the engine thread: a step every sampler skipped

    @property
    def last_step(self) -> int:
        """The newest step routed, or skipped at the source by every sampler."""
        return max(self.routed_step, self.skipped_step)

    # ------------------------------------------------------------- subscribers
    def subscribe(self, ident: bytes, sub: Subscription, now: float) -> tuple[Route, bool]:
        """Add a subscriber, or renew one that said HELLO again; True if new."""
        policy = policy_of(sub, clock=self._clock)
        route = self.routes.get(ident)
        if route is not None:
            route.resubscribe(sub, policy, now)
            self.snapshot = tuple(self.routes.values())  # what it wants may have changed
            return route, False
        route = self.routes[ident] = Route(
            ident,
            sub,
            policy,
            send=self._send,
            latency=self.latency,
            spill_dir=self._spill_dir,
            last_seen=now,
            acked_step=self.last_step,
            serial=self.joined,
        )
        self.joined += 1
        self.snapshot = tuple(self.routes.values())
        return route, True

    def discard(self, route: Route) -> None:
        """Forget a subscriber (``Route.close`` first)."""
        self.routes.pop(route.ident, None)
        self.snapshot = tuple(self.routes.values())

    def wanting(self, layer: int, hook: str) -> tuple[Route, ...]:
        """The subscribers whose layers and hooks take this tap (any thread: made
        once per snapshot and tap, then looked up)."""
        subs, by_tap = self._wanting
        if subs is not self.snapshot:
            subs, by_tap = self._wanting = (self.snapshot, {})
        got = by_tap.get((layer, hook))
        if got is None:
            got = by_tap[layer, hook] = tuple(s for s in subs if s.sub.wants(layer, hook))
        return got

    def close(self) -> None:
        """Delete every spill; let go of the region blocks held for subscribers."""
        for route in self.routes.values():
            route.reading.clear()
            if route.spill is not None:
                route.spill.close()
        if self._spill_root is not None:
            self._spill_root.close()

    def _spill_dir(self) -> Path:
        if self._spill_root is None:
            self._spill_root = SpillRoot(self._spill_parent)
        return self._spill_root.path

    # -------------------------------------------------------------- admission
    def admit(
        self, step: int, taps: Sequence[TapOffer], budget: int, first: bool
    ) -> list[Admission]:
        """``Outlet.admit`` for the engine thread: ``budget`` is what is left of the
        shared queue's bytes; ``first``: the queue is empty (one message always fits).
        Room is spent tap by tap, so a step of many taps copies only as many as fit."""
        room: dict[str, int] = {}  # per lossy subscriber or group: messages that still fit
        out = []
        for layer, hook, nbytes, for_return in taps:
            wanted = [s for s in self.wanting(layer, hook) if for_return or not s.sub.returned_only]
            if not wanted:
                self.engine_counts["not_wanted"] += 1
                out.append(Admission.NONE)
                continue
            if all(s.policy.skips(step) for s in wanted):
                # Only samplers want it, and none samples this step: nothing to copy,
                # queue or route (a sampled-out step is neither a drop nor a gap).
                for s in wanted:
                    s.sampled_at_source += 1
                self.engine_counts["sampled_out"] += 1
                self.skipped_step = max(self.skipped_step, step)
                out.append(Admission.NONE)
                continue
            lossless = any(s.policy.lossless for s in wanted)
            if not lossless and nbytes > budget and not first:
                out.append(Admission.DROP)
                continue
            units: dict[str, list[Route]] = {}
            for s in wanted:
                units.setdefault(s.unit, []).append(s)
            takers = []
            for key, members in units.items():
                if key not in room:
                    # A group's backlog is counted on each member: subtract it once.
                    free = sum(max(0, m.policy.room(m, step, nbytes)) for m in members)
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

    def counting(self, header: Header) -> tuple[Route, ...]:
        """The subscribers a newly queued message is counted for (``Route.ahead``)."""
        return self.wanting(header.layer, header.hook)

    # ---------------------------------------------------------------- routing
    def can_take(self, item: Item) -> bool:
        """No lossless subscriber (or every member of a lossless group) is full."""
        if item.tensor is None:
            return True  # a source drop is only counted, never queued
        h = item.header
        groups: dict[str, list[Route]] = {}
        for_return = bool(h.ended) or any(h.rows.returned)
        for s in self.wanting(h.layer, h.hook):
            if s.sub.returned_only and not for_return:
                continue
            if s.sub.group:
                groups.setdefault(s.sub.group, []).append(s)
            elif s.policy.holds(s, item):
                return False
        return all(self.pick(members, item) is not None for members in groups.values())

    def route_all(self, item: Item) -> None:
        """Route ``item`` (``can_take`` said yes) to every subscriber that wants it."""
        h = item.header
        routed = False
        groups: dict[str, list[Route]] = {}
        dropped = item.tensor is None
        lost = False  # some subscriber counted a drop at the source
        for s in self.wanting(h.layer, h.hook):  # a copy: a failed send removes one
            if dropped and s.policy.lossless:
                continue  # joined after admit() decided: it starts at a later message
            routed = True
            if s.sub.group:
                groups.setdefault(s.sub.group, []).append(s)
            else:
                lost |= s.take(item)
        for members in groups.values():
            member = self.pick(members, item)
            assert member is not None  # can_take checked it
            lost |= member.take(item)
        self.done(item)
        self.routed_step = max(self.routed_step, h.step)
        if dropped:
            self.counters["source_drops"] += lost  # a skipped sample step is not a drop
            return
        if not routed:
            self.counters["unrouted"] += 1
        # Counted once routed to every subscriber, so stats never show a message as
        # published that a subscriber's counters do not yet include.
        self.counters["published"] += 1

    @staticmethod
    def done(item: Item) -> None:
        """``item`` left the shared queue (routed, or lost before it)."""
        for s in item.counted:
            s.queued_out += 1

    @staticmethod
    def pick(members: list[Route], item: Item) -> Route | None:
        """The group member to take ``item`` (None: wait for one).

        A member with room comes first (credit, then least loaded). When all are
        full, a group with a lossless member waits for one rather than let a lossy
        member's policy drop; otherwise the least loaded member's policy applies.
        """
        nbytes = item.nbytes
        free = [s for s in members if not s.full(nbytes)]
        if not free:
            lossless = [s for s in members if s.policy.lossless]
            if lossless:
                free = [s for s in lossless if not s.policy.holds(s, item)]
                if not free:
                    return None
            else:
                free = members
        return min(
            free, key=lambda s: (not s.may_send(nbytes), len(s.inflight) + s.queued, s.c.routed)
        )
