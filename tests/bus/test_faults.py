"""Faults over real sockets and processes: busy consumers, frozen and killed peers."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from actbus.bus import Batch, Event, Publisher, Subscriber, Subscription
from tests.support.bus_procs import Proc, message
from tests.support.procs import ROOT, wait_for


@pytest.fixture
def publisher(address):
    """Drops a subscriber silent for 1 s."""
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1, subscriber_timeout_s=1.0)
    yield pub
    pub.close(timeout=2)


def _busy_consumer(publisher, address, read_on: bool = True, **kw) -> tuple[list[int], Subscriber]:
    """Reads one batch, spends 3 s in "on_batch" (3x the timeout), then reads on."""
    sub = Subscriber(address, Subscription(policy="block", window=2, name="busy"), **kw)
    sub.wait_welcome(10)
    threading.Thread(
        target=lambda: [publisher.publish(*message(i)) for i in range(40)], daemon=True
    ).start()
    steps: list[int] = []
    deadline = time.monotonic() + 7  # the pause, and then far more than 40 small reads need
    while len(steps) < 40 and time.monotonic() < deadline:
        out = sub.recv(timeout=0.2)
        if isinstance(out, Batch):
            steps.append(out.step)
            if len(steps) == 1:
                time.sleep(3.0)
                if not read_on:
                    break
    return steps, sub


def test_a_slow_on_batch_is_kept_alive_by_the_keepalive_socket(publisher, address):
    steps, sub = _busy_consumer(publisher, address)
    sub.close()
    assert steps == list(range(40)) and sub.stats.missed == 0
    st = publisher.stats()
    assert st.get("subscribers_timeout", 0) == 0 and st.get("resubscribed", 0) == 0


def test_without_keepalive_the_same_pause_is_taken_for_death(publisher, address):
    """The control for the test above: it can fail."""
    _, sub = _busy_consumer(publisher, address, read_on=False, keepalive=False)
    sub.close()
    assert publisher.stats()["subscribers_timeout"] == 1


def test_max_busy_lets_a_stuck_consumer_go(publisher, address):
    _, sub = _busy_consumer(publisher, address, read_on=False, max_busy_s=0.3)
    sub.close()
    assert publisher.stats()["subscribers_timeout"] == 1


def test_a_frozen_blocking_subscriber_stops_blocking_at_the_timeout(publisher, address):
    """SIGSTOP: the process lives but says nothing, not even keepalives."""
    stuck = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "stuck_subscriber.py"), address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stuck.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # alive and idle for longer than the timeout: kept by keepalives
        assert publisher.stats()["subscribers"], "an idle live subscriber was dropped"
        done = threading.Event()

        def feed():
            for i in range(20):  # 20 x 16 KiB through the 1 GiB queue, but "stuck" is
                publisher.publish(*message(i))  # lossless and never reads
            done.set()

        threading.Thread(target=feed, daemon=True).start()
        wait_for(lambda: publisher.stats()["queued"] > 0, 10, "the stream to be held back")
        stuck.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: publisher.stats()["published"] == 20, 10, "the stream to resume")
        assert 0.5 < time.monotonic() - t0 < 3.0
        assert publisher.stats()["subscribers_timeout"] == 1
    finally:
        stuck.send_signal(signal.SIGCONT)
        stuck.kill()
        stuck.wait(timeout=10)


@pytest.mark.usefixtures("bus_path")
def test_subscriber_resumes_after_the_publisher_is_killed_and_restarted(address):
    """kill -9 of the publisher process: no END is sent; the subscriber notices the
    silence, subscribes again, and the new publisher's stream flows."""
    first = Proc("publisher", address, "50")
    second = None
    sub = Subscriber(address, Subscription(name="s"), silence_s=1.0)
    try:
        first_id = first.ready(1)[0]
        assert sub.wait_welcome(20)["publisher_id"] == first_id
        before = [b for b in _batches(sub, 5)]
        first.kill()
        time.sleep(0.5)
        second = Proc("publisher", address, "50")
        second_id = second.ready(1)[0]
        deadline = time.monotonic() + 20
        while (sub.welcome or {}).get("publisher_id") != second_id:
            assert time.monotonic() < deadline, "no re-subscription to the new publisher"
            sub.recv(timeout=0.2)
        after = [b for b in _batches(sub, 5)]
    finally:
        sub.close()
        first.kill()
        if second is not None:
            second.kill()
    # (HELLOs sent while no publisher listened may reach the new one together.)
    assert len(before) == 5 and len(after) == 5 and sub.stats.welcomes >= 2
    assert after[0].step < 50, "the new stream starts from its own first steps"
    assert sub.stats.rejected == 0


def _batches(sub: Subscriber, n: int, timeout: float = 10.0) -> list[Batch]:
    got: list[Batch] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        out = sub.recv(timeout=0.2)
        if isinstance(out, Batch):
            got.append(out)
        assert not (isinstance(out, Event) and out.kind == "end")
    return got


def test_a_frozen_publisher_still_connected_is_waited_for_not_lost(address, caplog):
    """A publisher that says nothing while its connection stands is alive and busy (an
    engine warming up starves its thread): one INFO line, no "went quiet; subscribing
    again" warnings (the sink logged three during warm-up), not counted lost, and its
    stream goes on where it was. SIGSTOP freezes a real publisher process."""
    pub = Proc("publisher", address, "20")
    try:
        pub.ready(1)
        with Subscriber(address, Subscription(name="s"), silence_s=1.0) as sub:
            sub.wait_welcome(30)
            wait_for(lambda: isinstance(sub.recv(timeout=0.2), Batch), 10, "data")
            pub.popen.send_signal(signal.SIGSTOP)
            with caplog.at_level("INFO", logger="actbus.subscriber"):
                quiet_until = time.monotonic() + 6.0  # past its 4 s of silence
                while time.monotonic() < quiet_until:
                    sub.recv(timeout=0.2)
                pub.popen.send_signal(signal.SIGCONT)
                wait_for(lambda: isinstance(sub.recv(timeout=0.2), Batch), 10, "data again")
            assert sub.stats.lost == 0 and sub.stats.welcomes == 1
            said = [r.getMessage() for r in caplog.records if r.name == "actbus.subscriber"]
            assert not [m for m in said if "went quiet" in m], said
            busy = [m for m in said if "has sent nothing" in m]
            assert len(busy) == 1 and "but is still connected" in busy[0], said
    finally:
        pub.popen.send_signal(signal.SIGCONT)
        pub.kill()
