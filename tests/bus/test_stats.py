"""Accounting seen from outside: heartbeats, `actbus stats`, and the CLI's new flags."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time

import pytest

from actbus.bus import Batch, Event, Publisher, Subscriber, Subscription, statsview
from actbus.cli import main
from tests.support.bus_procs import message
from tests.support.procs import ROOT, wait_for


@pytest.fixture
def publisher(address):
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1, queue_bytes=1 << 18)
    yield pub
    pub.close(timeout=2)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "actbus.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_stats_client_gets_no_data_and_holds_nothing_back(publisher, address):
    """A lossless reader and a stats client that never reads: the stream still flows."""
    stats_sub = Subscriber(address, statsview.stats_subscription())
    reader = Subscriber(address, Subscription(policy="block", window=4, name="reader"))
    try:
        stats_sub.wait_welcome(10)
        reader.wait_welcome(10)
        done = threading.Event()

        def feed():  # 100 x 16 KiB through a 256 KiB queue
            for i in range(100):
                publisher.publish(*message(i))
            done.set()

        threading.Thread(target=feed, daemon=True).start()
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 100 and time.monotonic() < deadline:
            out = reader.recv(timeout=0.2)
            if isinstance(out, Batch):
                got.append(out.step)
        assert done.wait(10) and got == list(range(100))
        snap = statsview.request(stats_sub, 10)  # the stats client reads only now
        assert stats_sub.stats.received == 0
        mine = snap["subscribers"][statsview.CLIENT_NAME]
        assert mine["routed"] == 0 and mine["sent"] == 0
        assert snap["published"] == 100 and snap["unrouted"] == 0
        assert snap["subscribers"]["reader"]["sent"] == 100
        assert snap["latency"]["n"] == 100 and snap["latency"]["p50_ms"] >= 0
        assert snap["latency"]["p50_ms"] <= snap["latency"]["p99_ms"]
    finally:
        stats_sub.close()
        reader.close()


def test_heartbeats_carry_each_subscribers_own_accounting(publisher, address):
    with Subscriber(address, Subscription(policy="drop_newest", window=2, name="d")) as sub:
        sub.wait_welcome(10)
        for i in range(30):  # not read meanwhile: most are dropped
            publisher.publish(*message(i))
        wait_for(lambda: publisher.stats()["published"] == 30, 10, "all routed")
        beat = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the first heartbeat after routing finished
            out = sub.recv(timeout=0.2)
            if isinstance(out, Event) and out.kind == "heartbeat" and out.body["published"] == 30:
                beat = out.body
                break
        assert beat is not None
        you = beat["you"]
        assert you == sub.stats.publisher_view
        assert you["routed"] == 30 and you["dropped"]["queue_full"] > 0
        assert you["routed"] == you["sent"] + you["dropped"]["queue_full"] + you["queue_depth"]
        assert you["lag_steps"] > 0  # nothing acknowledged yet
        assert beat["latency"]["n"] >= 2


def test_actbus_stats_once_and_json(publisher, address, capsys):
    subs = [
        Subscriber(address, Subscription(policy="drop_oldest", window=2, name="trainer")),
        Subscriber(address, Subscription(policy="sample", sample_every=5, name="dash")),
    ]
    try:
        for s in subs:
            s.wait_welcome(10)
        for i in range(20):
            publisher.publish(*message(i))
        wait_for(lambda: publisher.stats()["published"] == 20, 10, "all routed")
        table = _cli("stats", "--connect", address, "--once")  # as a user runs it
        assert main(["stats", "--connect", address, "--json"]) == 0
        snap = json.loads(capsys.readouterr().out)
    finally:
        for s in subs:
            s.close()
    assert table.returncode == 0, table.stderr
    assert "published 20" in table.stdout
    lines = {ln.split()[1]: ln for ln in table.stdout.splitlines() if ln.startswith("│")}
    assert set(lines) == {"trainer", "dash"}  # the stats clients themselves are not listed
    assert "drop_oldest" in lines["trainer"] and "evicted=" in lines["trainer"]
    assert "sample:5" in lines["dash"]
    assert snap["subscribers"]["trainer"]["dropped"]["evicted"] > 0
    assert snap["subscribers"]["dash"]["sampled_out"] == 16


def test_actbus_stats_without_a_publisher_fails_clearly(tmp_path, capsys):
    assert main(["stats", "--connect", f"ipc://{tmp_path}/none.sock", "--timeout", "1"]) == 1
    assert "no publisher answered" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tags", "{bad"], "--tags: tags must be a JSON object"),
        (["--tags", '{"split": {"a": 1}}'], "--tags: tags['split']"),
        (["--policy", "spill:lots"], "--policy: spill needs a cap in MiB"),
        (["--policy", "spill:4:sample"], "--policy: spill fallback 'sample' is unknown"),
    ],
)
def test_run_refuses_bad_flags_by_name(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "null", "--connect", f"ipc://{tmp_path}/x.sock", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_consumer_subscription_carries_the_new_fields():
    from consumers.null import NullConsumer

    s = NullConsumer().subscription(
        policy="spill:64:drop_oldest", match={"split": ["train", "dev"]}, group="ranks"
    )
    assert (s.policy, s.spill_mb, s.spill_fallback) == ("spill", 64.0, "drop_oldest")
    assert s.match == {"split": ["train", "dev"]} and s.group == "ranks" and s.name == "null"
    assert Subscription.from_wire(s.to_wire()) == s


@pytest.mark.parametrize(
    "match", [["--match", "split=train"], ["--tags", '{"split": "train"}']], ids=["match", "tags"]
)
def test_group_and_match_flags_reach_the_publisher(match, publisher, address, tmp_path):
    """--match (and its deprecated spelling --tags) filters requests at the publisher."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actbus.cli",
            "run",
            "null",
            "--connect",
            address,
            "--group",
            "ranks",
            *match,
            "--policy",
            "spill:8:block",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: "null" in publisher.stats()["subscribers"], 30, "the consumer to join")
        st = publisher.stats()["subscribers"]["null"]
        assert st["group"] == "ranks" and st["policy"] == "spill:8:block"
        publisher.publish(*message(0))  # its one request has no tags: filtered out
        wait_for(
            lambda: publisher.stats()["subscribers"]["null"]["filtered_out"] == 1, 10, "filtered"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_stats_of_several_publishers_are_shown_per_publisher(tmp_path):
    """Fan-in: each publisher's own counters, under its address, run and DP rank; one
    that never answers is named, and the others are still shown."""
    addrs = [f"ipc://{tmp_path}/rank-{r}.sock" for r in range(3)]
    pubs = [
        Publisher(a, info={"model": "t", "dp_rank": r}, heartbeat_s=0.1)
        for r, a in enumerate(addrs[:2])  # rank 2 never starts
    ]
    try:
        for k, pub in enumerate(pubs):
            for i in range(3 + k):
                pub.publish(*message(i))
        spec = f"ipc://{tmp_path}/rank-{{0..2}}.sock"
        out = _cli("stats", "--connect", spec, "--json", "--timeout", "5")
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout.strip().splitlines()[-1])
        assert snap["silent"] == [addrs[2]]
        assert list(snap["publishers"]) == addrs[:2]
        for k, pub in enumerate(pubs):
            mine = snap["publishers"][addrs[k]]
            assert (mine["publisher_id"], mine["dp_rank"]) == (pub.id, k)
            assert mine["published"] == 3 + k
        table = _cli("stats", "--connect", spec, "--once", "--timeout", "5")
        assert table.returncode == 0, table.stderr
        for k, pub in enumerate(pubs):
            assert f"publisher {addrs[k]}  run {pub.id}  dp rank {k}" in table.stdout
        assert f"publisher {addrs[2]}: no answer" in table.stdout
    finally:
        for pub in pubs:
            pub.close(timeout=2)


def test_actbus_stats_counts_the_expert_load_and_refuses_bad_router_rows(address, capsys):
    """``--json --experts-s``: the router rows the publisher sent, counted per layer
    until its END; rows that are no router choice are counted and left out."""
    import numpy as np
    import torch
    from rich.console import Console

    from actbus.wire import Header, RowIndex

    info = {"model": "moe", "layers": [1, 2], "router": {"num_experts": 4, "top_k": 2}}
    pub = Publisher(address, info=info, heartbeat_s=0.1)
    good = {1: [[0, 3, 0.75, 0.25], [3, 1, 0.5, 0.5]], 2: [[2, 0, 0.625, 0.375]]}
    bad = [[4, 0, 0.5, 0.5], [1.5, 0, 0.5, 0.5], [0, 1, float("nan"), 0.5]]

    def feed() -> None:
        wait_for(
            lambda: statsview.EXPERTS_NAME in pub.stats()["subscribers"], 30, "the router reader"
        )
        for step, (layer, rows) in enumerate([(1, good[1] + bad), (2, good[2])]):
            n = len(rows)
            ri = RowIndex(["r"], np.array([0, n]), np.arange(n), np.arange(n))
            h = Header(step, layer, "router", "float32", (n, 4), "moe", ri)
            pub.publish(h, torch.tensor(rows, dtype=torch.float32))
        pub.close(timeout=10)  # END: stats prints what it counted

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        rc = main(["stats", "--connect", address, "--json", "--experts-s", "60"])
    finally:
        t.join(timeout=30)
        pub.close(timeout=2)
    assert rc == 0
    e = json.loads(capsys.readouterr().out)["experts"]
    assert (e["num_experts"], e["top_k"], e["bad_rows"], e["missed"]) == (4, 2, 3, 0)
    assert e["layers"]["1"]["counts"] == [1, 1, 0, 2] and e["layers"]["1"]["tokens"] == 2
    assert e["layers"]["1"]["weights"] == [0.75, 0.5, 0.0, 0.75]
    assert e["layers"]["2"]["counts"] == [1, 0, 1, 0] and e["layers"]["2"]["bad_rows"] == 0
    console = Console(width=200, record=True)
    console.print(statsview.render_experts(e))
    text = console.export_text()
    assert "4 experts, top 2" in text and "L1" in text and "3:50%" in text


def test_actbus_stats_experts_shows_the_counters_at_the_windows_end(address, capsys):
    """``--json --experts-s``: the counters printed beside the load are the publisher's
    after the rows it counted, not the ones asked for before it listened (``published 0
    last step -1`` over a window of traffic)."""
    import numpy as np
    import torch

    from actbus.wire import Header, RowIndex

    info = {"model": "moe", "layers": [1], "router": {"num_experts": 4, "top_k": 2}}
    pub = Publisher(address, info=info, heartbeat_s=0.1)

    def feed() -> None:  # once stats listens; it is not ended: the window runs out
        wait_for(
            lambda: statsview.EXPERTS_NAME in pub.stats()["subscribers"], 30, "the router reader"
        )
        for step in range(2):
            ri = RowIndex(["r"], np.array([0, 1]), np.arange(1), np.arange(1))
            h = Header(step, 1, "router", "float32", (1, 4), "moe", ri)
            pub.publish(h, torch.tensor([[0, 3, 0.75, 0.25]], dtype=torch.float32))

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        argv = ["stats", "--connect", address, "--json", "--experts-s", "4", "--interval", "0.5"]
        rc = main(argv)
    finally:
        t.join(timeout=30)
        pub.close(timeout=2)
    assert rc == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["experts"]["layers"]["1"]["tokens"] == 2, snap["experts"]
    assert (snap["published"], snap["last_step"]) == (2, 1), snap


def test_actbus_stats_json_shows_a_reply_holding_bytes(address, capsys):
    """A STATS reply is the publisher's msgpack: bytes values and keys are shown as
    hex and text, not a crash of ``--json``."""
    import msgpack
    import zmq

    from actbus.wire import HELLO, SCHEMA_VERSION, STATS, WELCOME

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 20000)
    router.bind(address)
    reply = {"published": 3, "odd": b"\x00\xff", b"key": [b"ab", {"deep": b"\x01"}]}

    def answer() -> None:
        with contextlib.suppress(zmq.ZMQError):
            while True:
                ident, tag, _ = router.recv_multipart()
                if tag == HELLO:
                    welcome = {"schema": SCHEMA_VERSION, "publisher_id": "p", "heartbeat_s": 60}
                    router.send_multipart([ident, WELCOME, msgpack.packb(welcome)])
                elif tag == STATS:
                    router.send_multipart([ident, STATS, msgpack.packb(reply)])
                    return

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        rc = main(["stats", "--connect", address, "--json", "--timeout", "20"])
    finally:
        t.join(timeout=30)
        router.close()
        ctx.term()
    assert rc == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap == {"published": 3, "odd": "00ff", "key": ["6162", {"deep": "01"}]}


def test_listening_asks_the_counters_with_a_short_wait_so_a_stop_ends_it_soon():
    """``--experts-s`` refreshes the counters while it listens; each ask waits at most
    ``--interval``, so a Ctrl-C (or a publisher gone) during an ask ends the listening
    within that, not after ``--timeout`` (a full-suite run waited out 120 s there)."""
    from actbus.bus.statsview import listen

    class Watch:
        ended = stopped = False

        def pump(self, seconds: float) -> None:
            pass

    watch, asked = Watch(), []

    def again(timeout: float) -> dict:
        asked.append(timeout)
        watch.stopped = True  # the stop comes while this ask waits
        return {"published": 1}

    assert listen(watch, 600.0, 1.0, again, {"published": 0}) == {"published": 1}  # type: ignore[arg-type]
    assert asked == [1.0]
