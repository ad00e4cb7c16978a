"""END for the subscribers of a publisher killed before it could send it (what ``actbus
serve`` does once vLLM, which kills its engine at shutdown, has exited): a real
publisher process killed with SIGKILL, real ``actbus run`` consumers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time

from actbus.bus import Batch, Event, Publisher, Subscriber, Subscription
from actbus.bus.farewell import announce_end
from actbus.bus.statsview import request as stats_of
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
            assert announce_end(address, linger_s=1.0, release_s=1.0) == 0
            wait_for(lambda: sub.recv(timeout=0.2) is not None, 5, "the publisher's heartbeat")
            assert sub.welcome is not None
    finally:
        pub.close(timeout=1)


STOPS = ["sigint", "sigterm", "kill"] * 6 + ["hung"] * 2


def _until_end(sub: Subscriber, deadline: float, got: dict) -> None:
    """Read until END (recorded in ``got``) or ``deadline``."""
    while time.monotonic() < deadline:
        out = sub.recv(timeout=0.2)
        if isinstance(out, Batch):
            got["batches"] = got.get("batches", 0) + 1
        elif isinstance(out, Event) and out.kind == "end":
            got["end"] = out.body
            return


def test_every_stop_ends_the_stream_whatever_order_the_server_stops_in(tmp_path):
    """Twenty stops of ``actbus serve``'s supervisor (``tests/support/stop_harness.py``:
    real processes, a real publisher, vLLM's server stood in for) with the race forced:
    the engine's worker holds the bus address 1.5 s after the server exited (SIGINT,
    SIGTERM, the engine core killed), or never lets go (hung: the supervisor kills it).
    Every subscriber gets END, every ``--exit-on-end`` consumer exits 0, every
    supervisor exits with its server's status. (The old farewell looked once, found the
    address still held, and told no one: they waited forever.)"""
    harness = Proc(str(tmp_path), *STOPS, module="tests.support.stop_harness")
    consumers: dict[int, subprocess.Popen] = {}
    subs: list[Subscriber] = []
    pids: dict[int, list[int]] = {}
    try:
        for line in harness.ready(len(STOPS), timeout=120):
            i, *ps = map(int, line.split())
            pids[i] = ps  # supervisor, engine core, worker
        addresses = [f"ipc://{tmp_path}/{i}/bus.sock" for i in range(len(STOPS))]
        for i in (0, 1, 2, len(STOPS) - 1):  # a real --exit-on-end consumer per kind of stop
            consumers[i] = subprocess.Popen(
                consumer_command("null", addresses[i], "--exit-on-end"),
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        subs = [Subscriber(a, Subscription(name=f"reader{i}")) for i, a in enumerate(addresses)]
        for i, sub in enumerate(subs):
            sub.wait_welcome(30)
            wait_for(lambda s=sub: isinstance(s.recv(timeout=0.2), Batch), 30, f"run {i} data")
        for i, c in consumers.items():
            wait_for(
                lambda i=i: "null" in stats_of(subs[i], 10)["subscribers"],
                60,
                f"run {i}'s consumer subscribed",
                0.5,
            )
            assert c.poll() is None, c.stdout.read()
        for i, stop in enumerate(STOPS):
            supervisor, engine_core, _ = pids[i]
            if stop == "kill":
                os.kill(engine_core, signal.SIGKILL)
            else:
                os.kill(supervisor, signal.SIGTERM if stop == "sigterm" else signal.SIGINT)
        # END within protocol bounds: 1.5 s held (4 s, then a kill, when hung), 3 s of
        # farewell, a subscriber's 1 s between HELLOs; far below this deadline.
        deadline = time.monotonic() + 60
        got = [{} for _ in subs]
        readers = [
            threading.Thread(target=_until_end, args=(s, deadline, g))
            for s, g in zip(subs, got, strict=True)
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert [i for i, g in enumerate(got) if "end" not in g] == []
        assert all(g["end"]["reason"] == "the server stopped" for g in got)
        for i, c in consumers.items():
            assert c.wait(timeout=60) == 0, (STOPS[i], c.stdout.read()[-2000:])
        exits = {}
        while len(exits) < len(STOPS):
            line = harness.line(60)
            if line.startswith("exit "):
                _, i, rc = line.split()
                exits[int(i)] = int(rc)
        assert exits == {i: 1 if s == "kill" else 0 for i, s in enumerate(STOPS)}
        for i, stop in enumerate(STOPS):
            log = (tmp_path / str(i) / "serve.log").read_text()
            told = re.search(r"told (\d+) subscriber\(s\) at ipc://", log)
            assert told and int(told[1]) >= (2 if i in consumers else 1), log
            assert ("killing what is left of its processes" in log) == (stop == "hung"), log
    finally:
        for s in subs:
            s.close()
        for c in consumers.values():
            if c.poll() is None:
                c.kill()
        for ps in pids.values():
            for p in ps:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        harness.kill()
