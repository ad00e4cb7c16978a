"""Admission: the engine asks the bus before copying, so unwanted data costs nothing.

Driven the way the capture worker drives it (``admit`` per tap, then ``publish`` or
``drop``), over real sockets. A drop at the source is a drop like any other: counted
per subscriber (reason ``source``), a gap the subscriber sees, inside the
accounting invariant; a lossless subscriber is never dropped for.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from actbus.bus import Batch, Publisher, Subscriber, Subscription
from actbus.bus.publisher import Admission
from actbus.wire import Header, RequestEnd, RowIndex
from tests.support.procs import recv_batches, wait_for

ROWS, HIDDEN = 4, 64
NBYTES = ROWS * HIDDEN * 4


@pytest.fixture
def publisher(address):
    pub = Publisher(address, info={"model": "test"}, heartbeat_s=0.1, subscriber_timeout_s=30)
    yield pub
    pub.close(timeout=2)


def _header(step: int, layer: int = 0, ended: list[RequestEnd] | None = None) -> Header:
    ri = RowIndex(["r"], np.array([0, ROWS]), np.arange(ROWS), np.arange(ROWS))
    return Header(step, layer, "post_block", "float32", (ROWS, HIDDEN), "t", ri, ended=ended or [])


def _offer(pub: Publisher, step: int, layer: int = 0, ended=None) -> Admission:
    """What the capture worker does for one tap of one step."""
    (verdict,) = pub.admit(step, [(layer, "post_block", NBYTES, bool(ended))])
    if verdict is Admission.SEND:
        pub.publish(_header(step, layer, ended), torch.full((ROWS, HIDDEN), float(step)))
    elif verdict is Admission.DROP:
        pub.drop(_header(step, layer, ended))
    return verdict


def _invariant(st: dict) -> None:
    assert st["routed"] == st["sent"] + sum(st["dropped"].values()) + st["queue_depth"], st


def _settled(pub: Publisher, steps: int) -> None:
    wait_for(lambda: pub.stats()["last_step"] == steps - 1 and not pub.stats()["queued"], 10, "")


def test_nobody_subscribed_means_nothing_is_copied(publisher, address):
    assert [_offer(publisher, i) for i in range(5)] == [Admission.NONE] * 5
    with Subscriber(address, Subscription(layers=[1], name="l1")) as sub:
        sub.wait_welcome(10)
        assert _offer(publisher, 5, layer=0) is Admission.NONE  # not its layer
        assert _offer(publisher, 5, layer=1) is Admission.SEND
        wait_for(lambda: publisher.stats()["published"] == 1, 10, "the message routed")
    st = publisher.stats()
    assert st["not_wanted"] == 6 and st["published"] == 1, st


def test_a_full_lossy_subscriber_is_dropped_for_at_the_source(publisher, address):
    with Subscriber(address, Subscription(policy="drop_newest", window=2, name="d")) as sub:
        sub.wait_welcome(10)
        verdicts = []
        for i in range(40):  # never read: 2 in flight, 8 pending, then full
            verdicts.append(_offer(publisher, i))
            wait_for(lambda i=i: publisher.stats()["last_step"] == i, 10, "routed")
        st = publisher.stats()["subscribers"]["d"]
        _invariant(st)
        assert verdicts[:10] == [Admission.SEND] * 10, verdicts
        assert set(verdicts[10:]) == {Admission.DROP}, verdicts
        assert st["dropped"] == {"source": 30} and publisher.stats()["source_drops"] == 30
        got = []
        deadline = time.monotonic() + 10
        while len(got) + sub.stats.missed < 40 and time.monotonic() < deadline:
            out = sub.recv(timeout=0.2)
            if isinstance(out, Batch):
                got.append(out)
                assert float(out.tensor[0, 0]) == out.step
        # Reading frees it: offers are copied again, and every gap is accounted for.
        assert _offer(publisher, 40) is Admission.SEND
    assert [b.step for b in got] == list(range(10)) and sub.stats.missed == 30


def test_a_lossless_subscriber_always_gets_the_copy(publisher, address):
    block = Subscriber(address, Subscription(policy="block", window=64, name="b"))
    lossy = Subscriber(address, Subscription(policy="drop_newest", window=1, name="d"))
    try:
        block.wait_welcome(10)
        lossy.wait_welcome(10)
        got = []
        for i in range(30):
            assert _offer(publisher, i) is Admission.SEND
            out = block.recv(timeout=5)
            while not isinstance(out, Batch):
                out = block.recv(timeout=5)
            got.append(out.step)
        _settled(publisher, 30)
        subs = publisher.stats()["subscribers"]
        assert got == list(range(30)) and subs["b"]["dropped"] == {}
        assert subs["d"]["dropped"].get("queue_full", 0) > 0  # dropped by the bus, not at source
        assert "source" not in subs["d"]["dropped"]
        _invariant(subs["d"])
    finally:
        block.close()
        lossy.close()


def test_steps_a_sampler_does_not_want_are_not_copied(publisher, address):
    with Subscriber(address, Subscription(policy="sample", sample_every=3, name="s")) as sub:
        sub.wait_welcome(10)
        verdicts = [_offer(publisher, i) for i in range(9)]
        _settled(publisher, 9)
        got = [b.step for b in recv_batches(sub, 3)]
        st = publisher.stats()["subscribers"]["s"]
    # The skipped steps cost nothing: not copied, not even queued to be counted.
    assert verdicts == [Admission.SEND if i % 3 == 0 else Admission.NONE for i in range(9)]
    assert got == [0, 3, 6] and st["sampled_out"] == 6 and st["dropped"] == {}
    assert st["routed"] == 3 and publisher.stats()["published"] == 3
    assert publisher.stats()["source_drops"] == 0  # skipped steps are not drops
    assert sub.stats.missed == 0  # not sampled is not a gap


def test_request_ends_survive_a_source_drop(publisher, address):
    """A step dropped at the source (here: as if the shared queue were full) still
    tells subscribers which requests ended, in a message with no rows."""
    with Subscriber(address, Subscription(policy="drop_newest", window=4, name="d")) as sub:
        sub.wait_welcome(10)
        end = RequestEnd("req-7", 0, "stop")
        _offer(publisher, 0)
        publisher.drop(_header(1, ended=[end]))
        _offer(publisher, 2)
        got = recv_batches(sub, 3)
        # A message can arrive before the publisher thread has counted it as sent.
        wait_for(lambda: publisher.stats()["subscribers"]["d"]["sent"] == 3, 10, "sent counted")
        st = publisher.stats()["subscribers"]["d"]
    assert [(b.step, b.tensor.shape[0], b.header.ended) for b in got] == [
        (0, ROWS, []),
        (1, 0, [end]),
        (2, ROWS, []),
    ]
    assert [b.seq for b in got] == [0, 2, 3] and sub.stats.missed == 1  # the dropped rows
    assert st["dropped"] == {"source": 1} and st["sent"] == 3
    _invariant(st)


def test_a_step_of_many_taps_copies_only_what_fits(publisher, address):
    """32 taps in one step, a lossy subscriber with room for a few: the rest are
    dropped at the source, none after a copy, and every one is a counted gap."""
    with Subscriber(address, Subscription(policy="drop_newest", window=2, name="d")) as sub:
        sub.wait_welcome(10)
        taps = [(layer, "post_block", NBYTES, False) for layer in range(32)]
        verdicts = publisher.admit(0, taps)
        for (layer, *_), v in zip(taps, verdicts, strict=True):
            if v is Admission.SEND:
                publisher.publish(_header(0, layer), torch.full((ROWS, HIDDEN), float(layer)))
            else:
                publisher.drop(_header(0, layer))
        wait_for(lambda: publisher.stats()["subscribers"]["d"]["routed"] == 32, 10, "routed")
        # The next step sees what is still queued for it: nothing more fits.
        assert set(publisher.admit(1, taps)) == {Admission.DROP}
        st = publisher.stats()["subscribers"]["d"]
    sent = [v is Admission.SEND for v in verdicts]
    assert sent == [True] * 10 + [False] * 22, verdicts  # 2 in flight + 8 pending
    assert st["dropped"] == {"source": 22}, st
    _invariant(st)


def test_a_group_shares_its_room(publisher, address):
    """Two drop_newest members of one group that never read: the group takes what
    both can hold (2 in flight + 8 pending each), the rest is dropped at the source."""
    subs = [
        Subscriber(address, Subscription(policy="drop_newest", window=2, group="g", name=n))
        for n in ("a", "b")
    ]
    try:
        for sub in subs:
            sub.wait_welcome(10)
        verdicts = []
        for i in range(40):
            verdicts.append(_offer(publisher, i))
            wait_for(lambda i=i: publisher.stats()["last_step"] == i, 10, "routed")
        st = publisher.stats()["subscribers"]
    finally:
        for sub in subs:
            sub.close()
    assert verdicts.count(Admission.SEND) == 20, verdicts
    assert sum(st[n]["dropped"].get("source", 0) for n in "ab") == 20
    assert all("queue_full" not in st[n]["dropped"] for n in "ab"), st


def test_the_return_subscriber_wants_only_returned_rows_and_ends(publisher, address):
    """The front end's subscriber for returned rows (lossless) must not make the
    engine copy taps that hold nothing for it."""
    with Subscriber(address, Subscription(returned_only=True, name="ret")) as ret:
        ret.wait_welcome(10)
        plain = publisher.admit(0, [(0, "post_block", NBYTES, False)])
        asked = publisher.admit(0, [(0, "post_block", NBYTES, True)])
    assert plain == [Admission.NONE] and asked == [Admission.SEND]


@pytest.mark.parametrize("beside_lossless", [False, True])
def test_a_rate_sampler_takes_whole_steps_at_most_r_a_second(publisher, address, beside_lossless):
    """``sample:10/s``: the steps it takes are at least 0.1 s apart, each whole (every
    tap), and the rest cost no copy. Beside a lossless subscriber every step is copied
    and routed, and routing must agree with what admit decided."""
    rate, steps = 10.0, 120
    taps = [(0, "post_block", NBYTES, False), (1, "post_block", NBYTES, False)]
    sampler = Subscriber(address, Subscription(policy="sample", sample_per_s=rate, name="r"))
    block = Subscriber(address, Subscription(window=1024, name="b")) if beside_lossless else None
    try:
        for s in (sampler, block):
            if s is not None:
                s.wait_welcome(10)
        when: dict[int, tuple[float, float]] = {}  # step -> (before, after) its admit
        sent: list[int] = []
        for step in range(steps):
            t0 = time.monotonic()
            verdicts = publisher.admit(step, taps)
            when[step] = (t0, time.monotonic())
            if Admission.SEND in verdicts:
                assert verdicts == [Admission.SEND] * 2, verdicts  # a step is taken whole
                sent.append(step)
                for layer, *_ in taps:
                    publisher.publish(_header(step, layer), torch.full((ROWS, HIDDEN), float(step)))
            time.sleep(0.01)
        elapsed = when[steps - 1][1] - when[0][0]
        _settled(publisher, steps)
        wait_for(lambda: not publisher.stats()["subscribers"]["r"]["queue_depth"], 10, "sent")
        st = publisher.stats()["subscribers"]["r"]
        got = recv_batches(sampler, st["sent"])
    finally:
        sampler.close()
        if block is not None:
            block.close()
    taken = sorted({b.step for b in got})
    assert [b.step for b in got] == [s for s in taken for _ in taps]  # whole steps, in order
    if not beside_lossless:
        assert taken == sent  # nothing copied that it did not take
    # At most R a second: two taken steps were decided at least 1/R s apart.
    for a, b in itertools.pairwise(taken):
        assert when[b][1] - when[a][0] >= 1 / rate, (a, b, when[a], when[b])
    assert 3 <= len(taken) <= elapsed * rate + 1, (len(taken), elapsed)
    assert len(got) == st["sent"] == 2 * len(taken) and st["dropped"] == {}
    assert st["sampled_out"] == 2 * (steps - len(taken))  # the rest: not drops, not gaps
    assert sampler.stats.missed == 0
    assert st["policy"] == "sample:10/s"
