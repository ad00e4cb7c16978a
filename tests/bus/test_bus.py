"""The bus over real ZeroMQ sockets: credit, policies, late joiners, faults."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from actbus.bus import Event, Publisher, Subscriber, Subscription, SubscriptionRejected
from actbus.wire import HELLO, SCHEMA_VERSION, Header, RowIndex
from tests.support.bus_procs import Proc
from tests.support.procs import ROOT, recv_batches, wait_for


@pytest.fixture
def publisher(address):
    pub = Publisher(
        address,
        info={"model": "test"},
        queue_bytes=1 << 16,
        heartbeat_s=0.1,
        subscriber_timeout_s=30,
    )
    yield pub
    pub.close(timeout=2)


def _msg(step: int, layer: int = 0, rows: int = 4, hidden: int = 64):
    ri = RowIndex(["r"], np.array([0, rows]), np.arange(rows), np.arange(rows))
    hdr = Header(step, layer, "post_block", "float32", (rows, hidden), "test", ri)
    return hdr, torch.full((rows, hidden), float(step))


@pytest.mark.usefixtures("bus_path")
def test_block_subscriber_receives_everything_in_order(publisher, address):
    with Subscriber(address, Subscription(window=4, name="a")) as sub:
        sub.wait_welcome(10)
        feeder = threading.Thread(
            target=lambda: [publisher.publish(*_msg(i)) for i in range(300)], daemon=True
        )
        feeder.start()
        got = recv_batches(sub, 300)
        feeder.join(timeout=10)
    assert [b.step for b in got] == list(range(300))
    assert [b.seq for b in got] == list(range(300)) and sub.stats.missed == 0
    assert all(float(b.tensor[0, 0]) == b.step for b in got)


@pytest.mark.usefixtures("bus_path")
def test_drop_newest_is_counted_and_does_not_slow_block(publisher, address):
    fast = Subscriber(address, Subscription(policy="block", window=8, name="fast"))
    slow = Subscriber(address, Subscription(policy="drop_newest", window=2, name="slow"))
    fast.wait_welcome(10)
    slow.wait_welcome(10)
    feeder = threading.Thread(
        target=lambda: [publisher.publish(*_msg(i)) for i in range(200)], daemon=True
    )
    feeder.start()
    got = recv_batches(fast, 200)  # the slow one does not read at all meanwhile
    feeder.join(timeout=10)
    assert [b.step for b in got] == list(range(200))
    wait_for(lambda: publisher.stats()["published"] == 200, 10, "all routed")
    st = publisher.stats()["subscribers"]["slow"]
    assert st["sent"] + st["pending"] + sum(st["dropped"].values()) == 200
    assert st["dropped"]["queue_full"] > 150
    late = recv_batches(slow, st["sent"], timeout=5)
    assert len(late) == st["sent"]
    fast.close()
    slow.close()


@pytest.mark.usefixtures("bus_path")
def test_layer_filter(publisher, address):
    with Subscriber(address, Subscription(layers=(1,), name="l1")) as sub:
        sub.wait_welcome(10)
        for i in range(10):
            publisher.publish(*_msg(i, layer=i % 2))
        got = recv_batches(sub, 5)
    assert [b.layer for b in got] == [1] * 5 and [b.seq for b in got] == list(range(5))


@pytest.mark.usefixtures("bus_path")
def test_late_joiner_starts_at_current_step(publisher, address):
    for i in range(20):
        publisher.publish(*_msg(i))
    wait_for(lambda: publisher.stats()["published"] == 20, 10, "early messages to be published")
    with Subscriber(address, Subscription(name="late")) as sub:
        assert sub.wait_welcome(10)["step"] == 19
        for i in range(20, 25):
            publisher.publish(*_msg(i))
        got = recv_batches(sub, 5)
    assert [b.step for b in got] == list(range(20, 25))


def test_schema_mismatch_is_refused_clearly(publisher, address):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart([HELLO, msgpack.packb({"schema": SCHEMA_VERSION + 1})])
    assert sock.poll(5000)
    tag, body = sock.recv_multipart()
    assert tag == b"X" and "install the same actbus version" in msgpack.unpackb(body)["reason"]
    sock.close(0)
    with pytest.raises(SubscriptionRejected, match="policy 'newest' is unknown"):
        Subscriber(address, Subscription(policy="newest")).wait_welcome(10)


def test_malformed_session_messages_are_counted_not_fatal(publisher, address):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    rng = np.random.default_rng(0)
    for i in range(300):
        frames = [
            bytes(rng.integers(0, 256, rng.integers(0, 40), dtype=np.uint8))
            for _ in range(1 + i % 4)
        ]
        sock.send_multipart(frames)
    sock.close(0)
    wait_for(lambda: publisher.stats()["rejected"] > 0, 10, "garbage counted")
    with Subscriber(address, Subscription(name="after")) as sub:
        sub.wait_welcome(10)
        publisher.publish(*_msg(0))
        assert len(recv_batches(sub, 1)) == 1


@pytest.mark.usefixtures("bus_path")
def test_killed_blocking_subscriber_stops_blocking(publisher, address):
    stuck = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "stuck_subscriber.py"), address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stuck.stdout.readline().strip() == "ready"
        done = threading.Event()

        def feed():
            for i in range(100):  # 100 KiB through a 64 KiB queue: must wait for "stuck"
                publisher.publish(*_msg(i))
            done.set()

        threading.Thread(target=feed, daemon=True).start()
        assert not done.wait(1.5), "publish did not block for a lossless subscriber"
        t_kill = time.monotonic()
        stuck.kill()
        assert done.wait(10), "publisher still blocked after the subscriber died"
        assert time.monotonic() - t_kill < 3.0
        assert publisher.stats()["subscribers_disconnected"] == 1
    finally:
        stuck.kill()


@pytest.mark.usefixtures("bus_path")
def test_end_and_resubscribe_after_publisher_restart(address):
    pub = Publisher(address, info={"model": "a"}, heartbeat_s=0.1)
    sub = Subscriber(address, Subscription(name="s"), silence_s=1.0)
    try:
        assert sub.wait_welcome(10)["model"] == "a"
        pub.close(timeout=2)
        ev = None
        deadline = time.monotonic() + 10
        while not (isinstance(ev, Event) and ev.kind == "end") and time.monotonic() < deadline:
            ev = sub.recv(timeout=0.5)
        assert isinstance(ev, Event) and ev.kind == "end"
        pub = Publisher(address, info={"model": "b"}, heartbeat_s=0.1)
        assert sub.wait_welcome(15)["model"] == "b"
        pub.publish(*_msg(0))
        assert len(recv_batches(sub, 1)) == 1
    finally:
        sub.close()
        pub.close(timeout=2)


@pytest.mark.usefixtures("bus_path")
def test_byte_credit_bounds_bytes_in_flight(publisher, address):
    """With 1 KiB-row messages and 8 KiB of byte credit, at most 8 are ever unacknowledged."""
    with Subscriber(address, Subscription(window=1000, window_bytes=8 * 1024, name="b")) as sub:
        sub.wait_welcome(10)
        for i in range(40):
            publisher.publish(*_msg(i))  # 4 rows x 64 x 4 B = 1 KiB each
        wait_for(lambda: publisher.stats()["subscribers"]["b"]["sent"] >= 8, 10, "first sends")
        time.sleep(0.5)  # nothing read yet: sending must have stopped at the byte credit
        st = publisher.stats()["subscribers"]["b"]
        assert st["sent"] == 8 and st["inflight_bytes"] == 8 * 1024, st
        got = recv_batches(sub, 40)
    assert [b.step for b in got] == list(range(40))


@pytest.mark.usefixtures("bus_path")
def test_oversized_message_goes_alone(publisher, address):
    with Subscriber(address, Subscription(window_bytes=100, name="tiny")) as sub:
        sub.wait_welcome(10)
        for i in range(3):
            publisher.publish(*_msg(i))  # 1 KiB each, 10x the byte window
        got = recv_batches(sub, 3)
    assert [b.step for b in got] == [0, 1, 2]


@pytest.mark.usefixtures("bus_path")
def test_drop_newest_sends_a_burst_it_has_credit_for(publisher, address):
    with Subscriber(address, Subscription(policy="drop_newest", window=64, name="d")) as sub:
        sub.wait_welcome(10)
        for i in range(40):  # a burst, like many layers of one step
            publisher.publish(*_msg(i))
        got = recv_batches(sub, 40)
        assert publisher.stats()["subscribers"]["d"]["dropped"] == {}
    assert [b.step for b in got] == list(range(40))


@pytest.mark.usefixtures("bus_path")
def test_every_drop_is_a_visible_gap(publisher, address):
    with Subscriber(address, Subscription(policy="drop_newest", window=2, name="g")) as sub:
        sub.wait_welcome(10)
        for i in range(50):
            publisher.publish(*_msg(i))
        wait_for(lambda: publisher.stats()["published"] == 50, 10, "all published")
        got = recv_batches(sub, 50, timeout=3)
        dropped = publisher.stats()["subscribers"]["g"]["dropped"]["queue_full"]
        deadline = time.monotonic() + 10  # trailing drops are learnt from a heartbeat
        while len(got) + sub.stats.missed < 50 and time.monotonic() < deadline:
            sub.recv(timeout=0.2)
    assert dropped > 0 and sub.stats.missed == dropped, (len(got), sub.stats.missed, dropped)
    assert len(got) + sub.stats.missed == 50
    steps = [b.step for b in got]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)


def test_a_consumer_pausing_longer_than_the_silence_limit_loses_nothing(publisher, address):
    with Subscriber(
        address, Subscription(policy="block", window=4, name="p"), silence_s=1.0
    ) as sub:
        sub.wait_welcome(10)
        feeder = threading.Thread(
            target=lambda: [publisher.publish(*_msg(i)) for i in range(60)], daemon=True
        )
        feeder.start()
        got = recv_batches(sub, 5)
        time.sleep(2.5)  # a slow step: well past silence_s, heartbeats pile up unread
        got += recv_batches(sub, 55)
        feeder.join(timeout=10)
    assert [b.step for b in got] == list(range(60))
    assert sub.stats.missed == 0 and sub.stats.welcomes == 1
    assert publisher.stats().get("resubscribed", 0) == 0


def test_subscriber_without_publisher_times_out_and_closes(tmp_path):
    sub = Subscriber(f"ipc://{tmp_path}/nobody.sock", silence_s=0.5)
    t0 = time.monotonic()
    assert sub.recv(timeout=2.5) is None
    with pytest.raises(TimeoutError, match="no publisher answered"):
        sub.wait_welcome(0.5)
    sub.close()
    assert time.monotonic() - t0 < 6


@pytest.mark.usefixtures("bus_path")
def test_drop_oldest_keeps_the_newest_and_counts_evictions(publisher, address):
    with Subscriber(address, Subscription(policy="drop_oldest", window=2, name="o")) as sub:
        sub.wait_welcome(10)
        for i in range(50):  # the subscriber does not read meanwhile
            publisher.publish(*_msg(i))
        wait_for(lambda: publisher.stats()["published"] == 50, 10, "all published")
        evicted = publisher.stats()["subscribers"]["o"]["dropped"]["evicted"]
        got = recv_batches(sub, 10)
    # Two went out on credit before the reader stalled; the 8 newest waited; the rest
    # were evicted oldest-first, each a gap the subscriber counted.
    assert [b.step for b in got] == [0, 1, *range(42, 50)]
    assert evicted == 40 and sub.stats.missed == 40


@pytest.mark.usefixtures("bus_path")
def test_sample_takes_every_nth_step(publisher, address):
    with Subscriber(address, Subscription(policy="sample", sample_every=5, name="s")) as sub:
        sub.wait_welcome(10)
        for i in range(50):
            publisher.publish(*_msg(i))
        got = recv_batches(sub, 10)
        # Steps 46-49 are sampled out after step 45 arrives: wait until all are routed.
        wait_for(lambda: publisher.stats()["published"] == 50, 10, "all published")
        st = publisher.stats()["subscribers"]["s"]
    assert [b.step for b in got] == list(range(0, 50, 5))
    assert st["sampled_out"] == 40 and st["dropped"] == {} and sub.stats.missed == 0


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("block", {"policy": "block"}),
        ("drop_oldest", {"policy": "drop_oldest"}),
        ("sample:10", {"policy": "sample", "sample_every": 10}),
        ("sample:0.25", {"policy": "sample", "sample_every": 4}),
        ("sample:5/s", {"policy": "sample", "sample_per_s": 5.0}),
        ("sample:0.5/s", {"policy": "sample", "sample_per_s": 0.5}),
        ("spill", {"policy": "spill", "spill_mb": 1024.0, "spill_fallback": "drop_newest"}),
        ("spill:0.5:block", {"policy": "spill", "spill_mb": 0.5, "spill_fallback": "block"}),
    ],
)
def test_parse_policy(text, parsed):
    from actbus.bus.protocol import parse_policy

    assert parse_policy(text) == parsed


@pytest.mark.parametrize(
    "text",
    [
        "newest",
        "block:2",
        "sample",
        "sample:x",
        "sample:-1",
        "sample:0/s",
        "sample:x/s",
        "sample:nan/s",
        "sample:/s",
        "spill:x",
        "spill:0",
        "spill:4:oops",
    ],
)
def test_parse_policy_rejects_with_the_choices(text):
    from actbus.bus.protocol import parse_policy

    with pytest.raises(ValueError, match=r"policy|sample|spill"):
        parse_policy(text)


def test_close_delivers_what_is_in_flight_and_then_end(address):
    """Closing right after publishing large messages loses none of them, nor END:
    close waits for acknowledgements, and the socket lingers for what is on its way."""
    pub = Publisher(address, info={"model": "test"}, queue_bytes=256 << 20, heartbeat_s=0.1)
    subs = Proc("subscribers", address, "slow:block:0.02:64")
    try:
        subs.ready(1)
        for step in range(40):  # 2 MiB each: ZeroMQ holds several when close is called
            pub.publish(*_msg(step, rows=128, hidden=4096))
        pub.close(timeout=60)
        r = subs.results(1, timeout=60)["slow"]
    finally:
        pub.close(timeout=1)
        subs.kill()
    assert r["steps"] == list(range(40)) and r["missed"] == 0
    assert r["ended"], "END was lost"
