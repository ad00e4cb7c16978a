"""Routing and policies without sockets, threads or sleeps.

The router's ``send`` is the ``Wire`` below: it decodes every frame a socket would
carry (real headers, real tensors, spill replays read back from real files), so
each test checks what a subscriber would receive. ``Bus`` drives the router as
the publisher thread does: route the shared queue's head while ``can_take`` says
so; an acknowledgement frees credit, flushes, and moves the queue on.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from actbus.bus.outlet import Admission, TapOffer
from actbus.bus.policies import POLICIES, DropNewest, parse_policy, policy_of, register
from actbus.bus.protocol import MIN_FRAME_BYTES, Subscription
from actbus.bus.routing import PENDING_LIMIT, Item, Route, Router
from actbus.wire import (
    DATA,
    Header,
    RequestEnd,
    RowIndex,
    WireError,
    frame_to_tensor,
    unpack_seq,
)

HIDDEN = 16
HOOK = "post_block"


@dataclass
class Got:
    seq: int
    proof: bytes
    header: Header
    tensor: torch.Tensor


class Wire:
    """Routing's ``send``: what each subscriber would receive, decoded."""

    def __init__(self) -> None:
        self.got: dict[bytes, list[Got]] = defaultdict(list)
        self.gone: set[bytes] = set()

    def __call__(self, frames: list) -> bool:
        ident, tag, seq, header, payload = frames
        if ident in self.gone:
            return False
        assert tag == DATA
        h = Header.decode(header)
        self.got[ident].append(Got(*unpack_seq(seq), h, frame_to_tensor(payload, h).clone()))
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Bus:
    """The publisher's loop around a router, minus the socket and the thread."""

    def __init__(self, tmp_path: Path) -> None:
        self.wire = Wire()
        self.clock = Clock()
        self.spill_dir = tmp_path
        self.router = Router(self.wire, spill_dir=tmp_path, clock=self.clock)
        self.queue: deque[Item] = deque()

    def join(self, name: str, policy: str = "block", **kw) -> Route:
        sub = Subscription(**parse_policy(policy), name=name, **kw)
        route, new = self.router.subscribe(name.encode(), sub, now=0.0)
        assert new
        return route

    def publish(self, header: Header, tensor: torch.Tensor) -> Item:
        item = Item(header, tensor, header.nbytes)
        item.counted = self.router.counting(header)
        for s in item.counted:
            s.queued_in += 1
        self.queue.append(item)
        self.pump()
        return item

    def drop(self, header: Header) -> None:
        """What ``Publisher.drop`` queues: a message nothing was copied for."""
        self.queue.append(Item(header, None, 0))
        self.pump()

    def pump(self) -> None:
        while self.queue:
            item = self.queue[0]
            if item.payload is None:
                item.materialize()
            if not self.router.can_take(item):
                return
            self.queue.popleft()
            self.router.route_all(item)

    def ack(self, route: Route) -> None:
        """The subscriber acknowledges everything it received."""
        got = self.wire.got[route.ident]
        route.ack(got[-1].seq + 1, got[-1].proof) if got else route.ack(0)
        route.flush()
        self.pump()

    def drain(self, *routes: Route) -> None:
        for _ in range(1000):
            if not (self.queue or any(r.queued or r.inflight for r in routes)):
                return
            for r in routes:
                self.ack(r)
        raise AssertionError("the bus did not drain")

    def seqs(self, route: Route) -> list[int]:
        return [g.seq for g in self.wire.got[route.ident]]

    def steps(self, route: Route) -> list[int]:
        return [g.header.step for g in self.wire.got[route.ident]]


def message(
    step: int,
    rows: int = 2,
    layer: int = 0,
    requests: list[tuple[str, int, dict]] | None = None,
    ended: list[RequestEnd] | None = None,
) -> tuple[Header, torch.Tensor]:
    """Every value of row i is ``1000 * step + i``; ``requests``: (id, rows, tags)."""
    requests = requests or [("r", rows, {})]
    counts = [n for _, n, _ in requests]
    n = sum(counts)
    ri = RowIndex(
        [r for r, _, _ in requests],
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        np.arange(n),
        np.arange(n) + 100,
        tags=[t for _, _, t in requests],
    )
    header = Header(step, layer, HOOK, "float32", (n, HIDDEN), "t", ri, ended=ended or [])
    tensor = (1000 * step + torch.arange(n, dtype=torch.float32))[:, None].repeat(1, HIDDEN)
    return header, tensor


def balanced(route: Route) -> bool:
    """Every message routed to it is in exactly one place (``accounting.py``)."""
    c = route.c
    waiting = len(route.pending) + route.spilled_now
    return c.routed == c.sent + sum(c.dropped.values()) + waiting


NBYTES = message(0)[0].nbytes


@pytest.fixture
def bus(tmp_path):
    b = Bus(tmp_path)
    yield b
    b.router.close()


# ----------------------------------------------------------------------- policies
def test_block_holds_the_shared_queue_and_loses_nothing(bus):
    b = bus.join("b", "block", window=2)
    for step in range(15):
        bus.publish(*message(step))
    # 2 in flight, PENDING_LIMIT waiting; then the shared queue itself waits.
    assert bus.seqs(b) == [0, 1] and len(b.pending) == PENDING_LIMIT
    assert len(bus.queue) == 15 - 2 - PENDING_LIMIT and not bus.router.can_take(bus.queue[0])
    assert b.c.routed == 10 and b.c.dropped == {} and balanced(b)
    bus.drain(b)
    assert bus.seqs(b) == list(range(15)) == bus.steps(b)
    assert b.c.sent == 15 and b.c.dropped == {} and balanced(b)
    got = bus.wire.got[b.ident]
    assert all(torch.equal(g.tensor, message(g.header.step)[1]) for g in got)


def test_drop_newest_drops_and_leaves_a_seq_gap(bus):
    d = bus.join("d", "drop_newest", window=1)
    for step in range(12):
        bus.publish(*message(step))
    assert not bus.queue  # a lossy subscriber never holds the shared queue
    assert d.c.dropped == {"queue_full": 3} and d.c.routed == 12 and balanced(d)
    bus.drain(d)
    bus.publish(*message(12))
    assert bus.seqs(d) == [*range(9), 12]  # seqs 9-11 were dropped: a gap the subscriber sees
    assert bus.steps(d) == [*range(9), 12]
    assert d.stats(12)["policy"] == "drop_newest" and balanced(d)


def test_drop_oldest_evicts_the_oldest_waiting_message(bus):
    d = bus.join("d", "drop_oldest", window=1)
    for step in range(12):
        bus.publish(*message(step))
    assert d.c.dropped == {"evicted": 3} and [seq for seq, _ in d.pending] == list(range(4, 12))
    bus.drain(d)
    assert bus.seqs(d) == [0, *range(4, 12)] == bus.steps(d)
    assert balanced(d)


def test_sample_every_n_takes_its_steps_with_no_gap(bus):
    s = bus.join("s", "sample:3")
    for step in range(10):
        bus.publish(*message(step))
    assert bus.steps(s) == [0, 3, 6, 9] and bus.seqs(s) == [0, 1, 2, 3]
    assert s.c.sampled_out == 6 and s.c.dropped == {} and balanced(s)
    # At the source: a step no sampler takes is not copied, and still not a drop.
    assert bus.router.admit(10, [TapOffer(0, HOOK, NBYTES, False)], 1 << 30, True) == [
        Admission.NONE
    ]
    assert bus.router.admit(12, [TapOffer(0, HOOK, NBYTES, False)], 1 << 30, True) == [
        Admission.SEND
    ]
    st = s.stats(bus.router.last_step)
    assert st["sampled_out"] == 7 and st["policy"] == "sample:3"
    assert bus.router.engine_counts["sampled_out"] == 1 and bus.router.last_step == 10


def test_sample_rate_follows_the_injected_clock_and_decides_each_step_once(bus):
    s = bus.join("s", "sample:5/s")  # one step per 0.2 s
    for step, t in [(0, 0.0), (1, 0.1), (2, 0.19), (3, 0.2), (4, 0.25), (5, 10.0)]:
        bus.clock.t = t
        bus.publish(*message(step))
    assert bus.steps(s) == [0, 3, 5] and bus.seqs(s) == [0, 1, 2]
    offer = [TapOffer(0, HOOK, NBYTES, False)]
    bus.clock.t = 10.1
    assert bus.router.admit(6, offer, 1 << 30, True) == [Admission.NONE]  # not due yet
    bus.clock.t = 11.0
    bus.publish(*message(6))  # published anyway (e.g. by another stage): the verdict stands
    assert bus.router.admit(7, offer, 1 << 30, True) == [Admission.SEND]
    bus.clock.t = 11.1  # routing meets step 7 later: it was taken when admitted
    bus.publish(*message(7))
    assert bus.steps(s) == [0, 3, 5, 7]
    assert s.c.sampled_out == 4 and s.sampled_at_source == 1 and s.c.dropped == {}
    assert str(s.policy) == "sample:5/s" and balanced(s)


def _spill_files(bus: Bus, route: Route) -> list[Path]:
    return sorted(bus.spill_dir.glob(f"actbus-spill-*/{route.ident.hex()}/seg-*.spill"))


def test_spill_writes_real_files_and_replays_them_in_order(bus):
    s = bus.join("s", "spill:1", window=1)
    for step in range(30):
        bus.publish(*message(step))
    spilled = 30 - 1 - PENDING_LIMIT
    assert s.c.spilled == spilled and s.spilled_now == spilled and s.c.dropped == {}
    files = _spill_files(bus, s)
    assert files and sum(f.stat().st_size for f in files) > spilled * NBYTES
    assert s.stats(29)["spill_depth"] == spilled and balanced(s)
    # Acknowledge a few: the memory queue drains first; the spill is not yet touched.
    for _ in range(3):
        bus.ack(s)
    assert s.spilled_now == spilled
    # A new message while anything is spilled goes behind it, even with room in memory.
    bus.publish(*message(30))
    assert s.spilled_now == spilled + 1 and s.c.spilled == spilled + 1
    bus.drain(s)
    assert bus.seqs(s) == list(range(31)) == bus.steps(s)
    assert s.c.replayed == spilled + 1 and s.c.sent == 31 and balanced(s)
    got = bus.wire.got[s.ident]
    assert all(torch.equal(g.tensor, message(g.header.step)[1]) for g in got)
    assert _spill_files(bus, s) == []  # replayed segments are deleted


def _spill_mb(fits: int) -> float:
    """A spill cap that holds exactly ``fits`` test messages, as they go on the wire."""
    header, _ = message(0)
    wire = len(header.encode()) + header.nbytes
    return (fits * wire + wire // 2) / (1 << 20)


def test_spill_fallback_drop_newest_drops_past_the_cap(bus):
    s = bus.join("s", f"spill:{_spill_mb(3)!r}:drop_newest", window=1)
    for step in range(14):
        bus.publish(*message(step))
    assert s.spilled_now == 3 and s.c.dropped == {"spill_full": 2} and balanced(s)
    bus.drain(s)
    assert bus.seqs(s) == list(range(12)) and balanced(s)  # seqs 12 and 13: the gap


def test_spill_fallback_drop_oldest_evicts_the_oldest_spilled(bus):
    s = bus.join("s", f"spill:{_spill_mb(3)!r}:drop_oldest", window=1)
    for step in range(14):
        bus.publish(*message(step))
    assert s.spilled_now == 3 and s.c.dropped == {"spill_full": 2} and balanced(s)
    bus.drain(s)
    assert bus.seqs(s) == [*range(9), 11, 12, 13] == bus.steps(s)
    assert s.c.replayed == 3 and balanced(s)


def test_spill_fallback_block_holds_the_queue_at_the_cap(bus):
    s = bus.join("s", f"spill:{_spill_mb(3)!r}:block", window=1)
    for step in range(14):
        bus.publish(*message(step))
    assert s.policy.lossless and s.spilled_now == 3 and len(bus.queue) == 2
    bus.ack(s)  # room in memory now, but the spill is at its cap and goes first: still held
    assert s.spilled_now == 3 and len(bus.queue) == 2 and s.spill.nbytes <= s.policy.cap
    assert s.c.dropped == {} and balanced(s)
    bus.drain(s)
    assert bus.seqs(s) == list(range(14)) == bus.steps(s)
    assert s.c.dropped == {} and s.c.replayed >= 3 and balanced(s)


# ------------------------------------------------------------------ credit, acks
def test_credit_counts_messages_and_bytes_and_acks_are_cumulative(bus):
    m = bus.join("m", "block", window=3)
    for step in range(5):
        bus.publish(*message(step))
    assert [seq for seq, _, _ in m.inflight] == [0, 1, 2] and len(m.pending) == 2
    m.ack(2, m.proof(1))
    m.flush()
    assert [seq for seq, _, _ in m.inflight] == [2, 3, 4] and m.acked_step == 1
    m.ack(1, m.proof(0))  # a stale acknowledgement changes nothing
    assert len(m.inflight) == 3
    m.ack(5, m.proof(4))  # acks 3 and 4 were lost: the next one covers them, no credit leaks
    assert not m.inflight and m.inflight_bytes == 0 and m.acked_step == 4
    assert m.stats(4)["lag_steps"] == 0

    b = bus.join("b", "block", window=64, window_bytes=NBYTES * 5 // 2, layers=(1,))
    for step in range(4):
        bus.publish(*message(step, layer=1))
    assert len(b.inflight) == 2 and b.inflight_bytes == 2 * NBYTES

    big = bus.join("big", "block", window_bytes=NBYTES // 2, layers=(2,))
    for step in range(2):
        bus.publish(*message(step, layer=2))
    # Larger than its byte window: goes alone when nothing is in flight, then waits.
    assert bus.seqs(big) == [0] and len(big.pending) == 1
    bus.ack(big)
    assert bus.seqs(big) == [0, 1]


def test_an_ack_beyond_what_was_sent_is_refused_and_frees_nothing(bus):
    """A peer that acknowledged numbers never given out would free credit for
    messages never sent, and the publisher would send to it without end."""
    d = bus.join("d", "drop_newest", window=2)
    for step in range(4):
        bus.publish(*message(step))
    assert [seq for seq, _, _ in d.inflight] == [0, 1] and len(d.pending) == 2
    with pytest.raises(WireError, match=r"CREDIT acked=5 is beyond the messages sent"):
        d.ack(5)
    d.flush()
    assert [seq for seq, _, _ in d.inflight] == [0, 1] and bus.seqs(d) == [0, 1]
    d.ack(4, d.proof(3))  # up to the numbers given out: what is in flight is freed
    d.flush()
    assert bus.seqs(d) == [0, 1, 2, 3] and balanced(d)


def test_an_ack_without_the_receipt_of_what_it_frees_is_refused(bus):
    """A peer that never reads but guesses sequence numbers would free its credit
    and make the publisher queue for it without end: acks carry the receipt of the
    last message read, which only reading it gives."""
    g = bus.join("g", "drop_newest", window=2)
    for step in range(4):
        bus.publish(*message(step))
    for proof in (None, b"", bytes(8), g.proof(0)):
        with pytest.raises(WireError, match=r"CREDIT proof for acked=2 is not message 1's"):
            g.ack(2, proof)
    g.flush()
    assert [seq for seq, _, _ in g.inflight] == [0, 1] and bus.seqs(g) == [0, 1]
    g.ack(0)  # frees nothing: needs no receipt
    got = bus.wire.got[g.ident]
    assert got[1].proof == g.proof(1) != got[0].proof
    g.ack(2, got[1].proof)
    g.flush()
    assert bus.seqs(g) == [0, 1, 2, 3] and balanced(g)


def test_subscribers_that_want_no_tap_cost_nothing_per_message(bus):
    """Which subscribers want a tap is worked out once per set of subscribers, so
    idle ones (a stats client wants no layer) add nothing to admitting, counting and
    routing each message (thousands of them once saturated the publisher)."""
    asked = [0]

    class Counted(Subscription):
        def wants(self, layer: int, hook: str) -> bool:
            asked[0] += 1
            return super().wants(layer, hook)

    for i in range(100):
        bus.router.subscribe(b"idle%d" % i, Counted(layers=(), name=f"idle{i}"), now=0.0)
    b = bus.join("b")
    offer = TapOffer(0, HOOK, NBYTES, False)
    for step in range(50):
        assert bus.router.admit(step, [offer], 1 << 30, True) == [Admission.SEND]
        bus.publish(*message(step))
        bus.ack(b)
    assert bus.steps(b) == list(range(50))
    assert asked[0] <= 100  # once each, not once each per message


def test_a_failed_send_stops_and_closing_counts_what_waited(bus):
    d = bus.join("d", "drop_newest", window=2)
    bus.wire.gone.add(d.ident)  # the send callable reports it gone
    for step in range(3):
        bus.publish(*message(step))
    assert bus.seqs(d) == [] and len(d.pending) == 3 and d.c.sent == 0
    assert d.close("disconnected") == 0
    assert d.c.dropped == {"disconnected": 3} and not d.pending and balanced(d)
    bus.router.discard(d)
    assert bus.router.routes == {} and bus.router.snapshot == ()


def test_a_second_hello_keeps_the_queue_numbering_and_policy_state(bus):
    s = bus.join("s", "sample:5/s", window=1)
    for step in range(4):
        bus.clock.t = step * 0.25
        bus.publish(*message(step))
    policy, pending = s.policy, list(s.pending)
    assert len(s.inflight) == 1 and len(pending) == 3 and s.next_unsent == 1
    again, new = bus.router.subscribe(s.ident, s.sub, now=5.0)
    assert again is s and not new and s.policy is policy  # the sampler remembers its steps
    assert list(s.pending) == pending and s.next_seq == 4 and s.next_unsent == 1
    assert not s.inflight and s.last_seen == 5.0  # credit starts afresh
    s.flush()
    assert bus.seqs(s) == [0, 1]
    changed = Subscription(**parse_policy("drop_oldest"), window=1, name="s")
    bus.router.subscribe(s.ident, changed, now=6.0)
    assert str(s.policy) == "drop_oldest" and s.next_seq == 4


# ---------------------------------------------------------------- match filters
REQUESTS = [
    ("a", 2, {"split": "train"}),
    ("b", 3, {"split": "test"}),
    ("c", 4, {"split": "train", "lang": "fr"}),
]


def test_match_filters_cut_rows_once_per_distinct_filter(bus):
    everything = bus.join("all")
    t1 = bus.join("t1", match={"split": "train"})
    t2 = bus.join("t2", match={"split": "train"})
    langs = bus.join("langs", match={"lang": ["en", "fr"]})
    nope = bus.join("nope", match={"split": "nope"})
    item = bus.publish(*message(0, requests=REQUESTS))
    full = bus.wire.got[everything.ident][0]
    assert full.header.rows.request_ids == ["a", "b", "c"] and full.tensor.shape[0] == 9
    for r in (t1, t2):
        (g,) = bus.wire.got[r.ident]
        assert g.header.rows.request_ids == ["a", "c"]
        assert g.tensor[:, 0].tolist() == [0, 1, 5, 6, 7, 8]  # rows kept whole, in order
    (g,) = bus.wire.got[langs.ident]
    assert g.header.rows.request_ids == ["c"] and g.tensor[:, 0].tolist() == [5, 6, 7, 8]
    # One copy per distinct filter: t1 and t2 share theirs; "nope" has none.
    assert item.variants is not None and len(item.variants) == 3
    assert item.variants[t1.variant_key] is item.variants[t2.variant_key]
    assert item.variants[nope.variant_key] is None and everything.variant_key is None
    assert nope.c.filtered_out == 1 and nope.c.routed == 0 and nope.next_seq == 0  # no gap
    # A message whose every request matches goes as is, no copy.
    item = bus.publish(*message(1, requests=[REQUESTS[0]]))
    assert item.variants[t1.variant_key] is item
    # Request ends matter even with no rows for the filter: an empty message carries them.
    ends = [RequestEnd("b", 0, "stop")]
    bus.publish(*message(2, requests=[REQUESTS[1]], ended=ends))
    last = bus.wire.got[nope.ident][-1]
    assert last.header.ended == ends and last.tensor.shape[0] == 0
    assert all(balanced(r) for r in (everything, t1, t2, langs, nope))


def test_a_match_filter_costs_one_lookup_per_key_however_many_values():
    """Compiled once per subscriber: a request is checked with a set lookup per key,
    not a scan of every accepted value (a huge filter once made routing crawl)."""
    values = [f"v{i}" for i in range(500)]
    sub = Subscription(match={"k": values, "on": True, "n": [1, "one"]})

    class Counting:
        """A tag value that counts the comparisons made against it."""

        calls = 0

        def __hash__(self) -> int:
            return hash("v499")

        def __eq__(self, other: object) -> bool:
            Counting.calls += 1
            return other == "v499"

    assert sub.wants_request({"k": Counting(), "on": True, "n": 1})
    assert Counting.calls <= 2
    # The same meaning as before: True is not 1, 1 is 1.0, a list or map tag never
    # equals a scalar, a missing key never matches.
    assert sub.wants_request({"k": "v0", "on": True, "n": 1.0})
    assert not sub.wants_request({"k": "v0", "on": 1, "n": 1})
    assert not sub.wants_request({"k": "v0", "on": True, "n": True})
    assert not sub.wants_request({"k": ["v0"], "on": True, "n": 1})
    assert not sub.wants_request({"k": {"v0": 1}, "on": True, "n": 1})
    assert not sub.wants_request({"on": True, "n": 1})


def test_returned_only_keeps_returned_requests_and_ends(bus):
    ret = bus.join("ret", returned_only=True)
    header, tensor = message(0, requests=REQUESTS)
    header.rows.returned = [False, True, False]
    bus.publish(header, tensor)
    (g,) = bus.wire.got[ret.ident]
    assert g.header.rows.request_ids == ["b"] and g.tensor[:, 0].tolist() == [2, 3, 4]
    offer = TapOffer(0, HOOK, NBYTES, False)
    assert bus.router.admit(1, [offer], 1 << 30, True) == [Admission.NONE]
    assert bus.router.admit(1, [offer._replace(for_return=True)], 1 << 30, True) == [Admission.SEND]


# ------------------------------------------------------------ load-balanced groups
def test_a_group_sends_each_message_to_the_least_loaded_member_with_credit(bus):
    m1 = bus.join("m1", "drop_newest", window=1, group="g")
    m2 = bus.join("m2", "drop_newest", window=1, group="g")
    for step in range(4):
        bus.publish(*message(step))
    assert bus.steps(m1) == [0] and bus.steps(m2) == [1]  # each the one with credit
    assert [s for _, it in m1.pending for s in [it.header.step]] == [2]  # then least loaded
    assert [s for _, it in m2.pending for s in [it.header.step]] == [3]
    bus.ack(m2)  # sends step 3
    bus.ack(m2)  # only m2 has credit now: it gets the next one at once
    bus.publish(*message(4))
    assert bus.steps(m2) == [1, 3, 4] and len(m1.pending) == 1
    bus.drain(m1, m2)
    steps = bus.steps(m1) + bus.steps(m2)
    assert sorted(steps) == list(range(5))  # each message to exactly one member
    assert m1.c.routed + m2.c.routed == 5 and all(balanced(m) for m in (m1, m2))


def test_a_lossless_group_member_waits_rather_than_a_lossy_member_drops(bus):
    lb = bus.join("lb", "block", window=1, group="g")
    ld = bus.join("ld", "drop_newest", window=1, group="g")
    n = 2 * (1 + PENDING_LIMIT)  # both members' credit and memory queues
    for step in range(n + 3):
        bus.publish(*message(step))
    assert len(lb.pending) == len(ld.pending) == PENDING_LIMIT
    assert len(bus.queue) == 3 and ld.c.dropped == {}  # the group waits: nothing dropped
    bus.ack(ld)  # the lossy member has room again: it takes the next one
    assert len(bus.queue) == 2 and ld.c.dropped == {}
    bus.drain(lb, ld)
    assert sorted(bus.steps(lb) + bus.steps(ld)) == list(range(n + 3))
    assert lb.c.dropped == {} == ld.c.dropped


def test_a_lossy_group_drops_at_its_least_loaded_member_when_all_are_full(bus):
    m1 = bus.join("m1", "drop_newest", window=1, group="g")
    m2 = bus.join("m2", "drop_newest", window=1, group="g")
    n = 2 * (1 + PENDING_LIMIT)
    for step in range(n + 3):
        bus.publish(*message(step))
    assert not bus.queue
    dropped = sum(m.c.dropped["queue_full"] for m in (m1, m2))
    assert dropped == 3 and m1.c.routed + m2.c.routed == n + 3
    stats = [m.stats(n + 2) for m in (m1, m2)]
    assert all(st["group"] == "g" for st in stats) and all(balanced(m) for m in (m1, m2))


# -------------------------------------------------------------------- admission
def test_admission_drops_at_the_source_for_lossy_subscribers_only(bus):
    d = bus.join("d", "drop_newest", window=1, layers=(0,))
    offer = TapOffer(0, HOOK, NBYTES, False)
    verdicts = bus.router.admit(0, [offer] * 12, 1 << 30, True)
    room = 1 + PENDING_LIMIT  # credit and memory queue
    assert verdicts == [Admission.SEND] * room + [Admission.DROP] * (12 - room)
    for i, v in enumerate(verdicts):
        header, tensor = message(i)
        if v is Admission.SEND:
            bus.publish(header, tensor)
        else:
            bus.drop(header)
    assert d.c.dropped == {"source": 3} and bus.router.counters["source_drops"] == 3
    bus.drain(d)
    bus.publish(*message(12))
    assert bus.seqs(d) == [*range(room), 12]  # the source drops left a gap
    # Not wanted at all: nothing to copy.
    assert bus.router.admit(13, [TapOffer(5, HOOK, NBYTES, False)], 1 << 30, True) == [
        Admission.NONE
    ]
    assert bus.router.engine_counts["not_wanted"] == 1
    # With the shared queue's budget spent, a lossy-only tap is dropped at the source...
    assert bus.router.admit(13, [offer], NBYTES - 1, False) == [Admission.DROP]
    # ...but never one a lossless subscriber wants; it does not see the source drops.
    b = bus.join("b", "block")
    assert bus.router.admit(13, [offer] * 20, 0, False) == [Admission.SEND] * 20
    bus.drop(message(13)[0])
    assert b.c.routed == 0 and b.next_seq == 0 and balanced(d) and balanced(b)


def test_admission_counts_what_is_already_queued_ahead(bus):
    b = bus.join("b", "block", window=1, layers=(1,))
    d = bus.join("d", "drop_newest", window=1, layers=(0,))
    for step in range(1 + PENDING_LIMIT + 1):  # b is full: its last one holds the queue
        bus.publish(*message(step, layer=1))
    for step in range(3):  # so these wait behind it, not yet routed to d
        bus.publish(*message(step, layer=0))
    assert len(bus.queue) == 4 and d.ahead == 3 and not d.pending
    verdicts = bus.router.admit(3, [TapOffer(0, HOOK, NBYTES, False)] * 8, 1 << 30, False)
    room = 1 + PENDING_LIMIT - 3  # its credit and memory queue, less what is ahead
    assert verdicts == [Admission.SEND] * room + [Admission.DROP] * (8 - room)
    bus.drain(b, d)
    assert d.ahead == 0 and bus.steps(d) == [0, 1, 2]


# ------------------------------------------------------------- policy objects
@pytest.mark.parametrize(
    "text, canonical",
    [
        ("block", "block"),
        ("drop_newest", "drop_newest"),
        ("drop_oldest", "drop_oldest"),
        ("sample:10", "sample:10"),
        ("sample:0.25", "sample:4"),
        ("sample:5/s", "sample:5/s"),
        ("spill", "spill:1024:drop_newest"),
        ("spill:0.5:block", "spill:0.5:block"),
    ],
)
def test_a_policy_gives_its_text_and_its_wire_fields(text, canonical):
    p = parse_policy(text)
    assert str(p) == canonical and str(parse_policy(canonical)) == canonical
    sub = Subscription(**p)
    again = policy_of(Subscription.from_wire(sub.to_wire()))
    assert type(again) is type(p) and str(again) == canonical and dict(again) == dict(p)
    assert p.lossless == (canonical in ("block", "spill:0.5:block"))


def test_a_new_policy_is_one_registered_class(bus):
    @register
    class EvenSteps(DropNewest):
        name = "even_steps"

        def skips(self, step: int) -> bool:
            return step % 2 == 1

    try:
        assert str(parse_policy("even_steps")) == "even_steps"
        with pytest.raises(ValueError, match="even_steps"):
            parse_policy("nope")  # the usage now offers it too
        e = bus.join("e", "even_steps")
        for step in range(6):
            bus.publish(*message(step))
        assert bus.steps(e) == [0, 2, 4] and e.c.sampled_out == 3
    finally:
        del POLICIES["even_steps"]


def test_the_publisher_and_a_forwarding_stage_are_both_outlets():
    from actbus.bus.outlet import Outlet
    from actbus.bus.publisher import Publisher
    from actbus.capture.stages import StageForwarder

    assert issubclass(Publisher, Outlet) and issubclass(StageForwarder, Outlet)
    assert not issubclass(Router, Outlet)


def test_a_message_above_what_a_subscribers_socket_accepts_is_dropped_and_counted(bus):
    """A subscriber accepts frames up to its byte window (at least ``MIN_FRAME_BYTES``):
    a larger message would only close its connection, so it is a counted drop, a gap,
    for every policy, and the next message goes."""
    rows = MIN_FRAME_BYTES // (HIDDEN * 4) + 1
    for policy in ("block", "drop_newest"):
        s = bus.join(policy, policy, window_bytes=1 << 20, layers=(7,))
        bus.publish(*message(0, rows=rows, layer=7))
        bus.publish(*message(1, layer=7))
        assert bus.seqs(s) == [1] and s.c.dropped == {"oversized": 1} and balanced(s)
