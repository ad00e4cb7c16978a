"""END for the subscribers of a publisher killed before it could send it (what ``actbus
serve`` does once vLLM, which kills its engine at shutdown, has exited): a real
publisher process killed with SIGKILL, real ``actbus run`` consumers."""

from __future__ import annotations

import subprocess
import time

from actbus.bus import Event, Publisher, Subscriber, Subscription
from actbus.bus.farewell import announce_end
from actbus.cli import consumer_command
from tests.support.bus_procs import Proc
from tests.support.procs import ROOT, wait_for


def test_subscribers_of_a_killed_publisher_hear_end(tmp_path):
    """An ``--exit-on-end`` consumer and a busy subscriber (heard only through its
    keepalive) both get END and the consumer exits 0; without it they wait forever."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Proc("publisher", address, "20")
    busy = None
    consumer = subprocess.Popen(
        consumer_command("null", address, "--exit-on-end"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        pub.ready(1)
        busy = Subscriber(address, Subscription(name="busy"))
        busy.wait_welcome(30)
        time.sleep(3.0)  # the consumer subscribed and received
        pub.kill()
        time.sleep(1.0)
        assert consumer.poll() is None, "the consumer ended without END"
        t0 = time.monotonic()
        told = announce_end(address)
        assert told >= 2 and time.monotonic() - t0 < 5
        assert consumer.wait(timeout=30) == 0, consumer.stdout.read()[-2000:]
        ends = []
        deadline = time.monotonic() + 10
        while not ends and time.monotonic() < deadline:  # the busy one comes back to recv
            out = busy.recv(timeout=0.5)
            if isinstance(out, Event) and out.kind == "end":
                ends.append(out)
        assert ends and ends[0].body["reason"] == "the server stopped"
    finally:
        pub.kill()
        if consumer.poll() is None:
            consumer.kill()
        if busy is not None:
            busy.close()


def test_a_live_publisher_is_left_alone(tmp_path):
    """Nobody else's address is taken: while a publisher listens there, nothing is
    bound and its subscriber keeps its stream."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m"}, heartbeat_s=0.1)
    try:
        with Subscriber(address, Subscription(name="s")) as sub:
            sub.wait_welcome(10)
            assert announce_end(address, linger_s=1.0) == 0
            wait_for(lambda: sub.recv(timeout=0.2) is not None, 5, "the publisher's heartbeat")
            assert sub.welcome is not None
    finally:
        pub.close(timeout=1)
