"""Routing over real sockets: request-tag filters and load-balanced groups."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from actbus.bus import Publisher, Subscriber, Subscription
from actbus.wire import Header, RequestEnd, RowIndex
from tests.support.bus_procs import Proc, message
from tests.support.procs import recv_batches, wait_for

HIDDEN = 8


@pytest.fixture
def publisher(address):
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1)
    yield pub
    pub.close(timeout=2)


def _tagged(step: int, ended: list[RequestEnd] | None = None) -> tuple[Header, torch.Tensor]:
    """Three requests of 2, 3 and 4 rows; every value of row i is 100*step + i."""
    counts = [2, 3, 4]
    ri = RowIndex(
        ["a", "b", "c"],
        np.array([0, 2, 5, 9]),
        np.arange(9),
        np.arange(9) + 1000,
        tags=[{"split": "train"}, {"split": "test"}, {"split": "train", "lang": "fr"}],
    )
    rows = sum(counts)
    hdr = Header(step, 0, "post_block", "float32", (rows, HIDDEN), "t", ri, ended=ended or [])
    t = (100 * step + torch.arange(rows, dtype=torch.float32))[:, None].repeat(1, HIDDEN)
    return hdr, t


def test_tag_filters_cut_rows_and_keep_them_whole(publisher, address):
    subs = {
        "all": Subscriber(address, Subscription(name="all")),
        "train": Subscriber(address, Subscription(match={"split": "train"}, name="train")),
        "langs": Subscriber(address, Subscription(match={"lang": ["en", "fr"]}, name="langs")),
        "both": Subscriber(
            address, Subscription(match={"split": "train", "lang": "de"}, name="both")
        ),
    }
    try:
        for s in subs.values():
            s.wait_welcome(10)
        for step in range(3):
            publisher.publish(*_tagged(step))
        got = {k: recv_batches(s, 3, timeout=3 if k != "both" else 1) for k, s in subs.items()}
        wait_for(lambda: publisher.stats()["published"] == 3, 10, "all routed")
        st = publisher.stats()["subscribers"]
    finally:
        for s in subs.values():
            s.close()
    assert [b.header.rows.request_ids for b in got["all"]] == [["a", "b", "c"]] * 3
    for step, b in enumerate(got["train"]):
        rows = b.header.rows
        assert rows.request_ids == ["a", "c"] and list(rows.offsets) == [0, 2, 6]
        assert list(rows.positions) == [0, 1, 5, 6, 7, 8]
        assert list(rows.token_ids) == [1000, 1001, 1005, 1006, 1007, 1008]
        assert rows.tags == [{"split": "train"}, {"split": "train", "lang": "fr"}]
        assert b.tensor[:, 0].tolist() == [100 * step + i for i in (0, 1, 5, 6, 7, 8)]
        assert b.tensor.shape == (6, HIDDEN)
    assert [b.header.rows.request_ids for b in got["langs"]] == [["c"]] * 3
    assert [b.tensor.shape[0] for b in got["langs"]] == [4] * 3
    # Nothing matches: no message at all, and that is neither a drop nor a gap.
    assert got["both"] == [] and st["both"]["filtered_out"] == 3 and st["both"]["routed"] == 0
    assert subs["both"].stats.missed == 0
    assert all(st[k]["dropped"] == {} for k in st)


def test_returned_only_keeps_the_requests_that_asked(publisher, address):
    """The front end's subscriber for ``"return": true`` gets those requests' rows and
    every request end; a plain subscriber beside it still gets everything."""
    ends = [RequestEnd("a", 0, "length")]
    with (
        Subscriber(address, Subscription(returned_only=True, name="ret")) as ret,
        Subscriber(address, Subscription(name="all")) as every,
    ):
        ret.wait_welcome(10)
        every.wait_welcome(10)
        hdr, t = _tagged(0)
        hdr.rows.returned = [False, True, False]
        publisher.publish(hdr, t)
        publisher.publish(*_tagged(1))  # nobody asked: nothing for it
        publisher.publish(*_tagged(2, ended=ends))  # nobody asked, but an end: sent
        got, full = recv_batches(ret, 2), recv_batches(every, 3)
    assert [b.step for b in got] == [0, 2] and [b.step for b in full] == [0, 1, 2]
    rows = got[0].header.rows
    assert rows.request_ids == ["b"] and list(rows.positions) == [2, 3, 4]
    assert rows.returned == [True] and got[0].tensor[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert got[1].tensor.shape == (0, HIDDEN) and got[1].header.ended == ends
    assert full[0].header.rows.returned == [False, True, False]
    assert ret.stats.missed == 0


def test_a_filtered_message_with_only_request_ends_still_goes(publisher, address):
    ends = [RequestEnd("b", 0, "stop")]
    with Subscriber(address, Subscription(match={"split": "nope"}, name="f")) as sub:
        sub.wait_welcome(10)
        publisher.publish(*_tagged(0))  # no rows for it, no ends: not sent
        publisher.publish(*_tagged(1, ended=ends))  # no rows for it, but an end: sent
        got = recv_batches(sub, 1)
        assert len(got) == 1 and got[0].step == 1 and got[0].seq == 0
        assert got[0].tensor.shape == (0, HIDDEN) and got[0].header.ended == ends
        assert sub.stats.missed == 0


def test_group_members_share_the_stream_without_duplicates(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1)
    n = 300
    # A lossy member beside two lossless ones: the group waits for a lossless member
    # rather than let the lossy one drop.
    members = Proc(
        "subscribers",
        address,
        "m1@g:block:0.002:4",
        "m2@g:block:0.006:4",
        "m3@g:drop_newest:0.002:4",
    )
    broadcast = Proc("subscribers", address, "all:block:0:64")
    try:
        members.ready(3)
        broadcast.ready(1)
        for i in range(n):
            pub.publish(*message(i))
        wait_for(lambda: pub.stats()["published"] == n, 30, "all routed")

        def drained():
            subs = pub.stats()["subscribers"].values()
            return all(s["queue_depth"] == 0 and s["inflight"] == 0 for s in subs)

        wait_for(drained, 30, "members to drain")
        stats = pub.stats()
        time.sleep(0.5)
        pub.close(timeout=5)
        got = {**members.results(3), **broadcast.results(1)}
    finally:
        pub.close(timeout=1)
        members.kill()
        broadcast.kill()
    assert got["all"]["steps"] == list(range(n))  # broadcast: everything
    parts = [got[m]["steps"] for m in ("m1", "m2", "m3")]
    union = sorted(s for p in parts for s in p)
    assert union == list(range(n)), "a step went missing or twice"
    for m in ("m1", "m2", "m3"):
        st = stats["subscribers"][m]
        assert got[m]["steps"] == sorted(got[m]["steps"]) and got[m]["missed"] == 0, m
        assert got[m]["seqs"] == list(range(len(got[m]["seqs"]))), m
        assert st["routed"] == st["sent"] == got[m]["received"] > 0, (m, st)
    assert stats["groups"]["g"]["members"] == 3 and stats["groups"]["g"]["routed"] == n
    assert stats["groups"]["g"]["dropped"] == 0


def test_a_group_member_killed_midstream(tmp_path):
    """The survivor takes over; what the dead one held is counted, nothing duplicated."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1)
    n = 300
    victim = Proc("subscribers", address, "victim@g:block:0.01:4")
    survivor = Proc("subscribers", address, "survivor@g:block:0.002:4")
    try:
        victim.ready(1)
        survivor.ready(1)
        done = threading.Event()

        def feed():
            for i in range(n):
                pub.publish(*message(i))
                time.sleep(0.002)
            done.set()

        threading.Thread(target=feed, daemon=True).start()
        wait_for(lambda: pub.stats()["published"] > n // 3, 20, "a third published")
        victim.kill()
        assert done.wait(20), "the group stalled after a member died"
        wait_for(lambda: pub.stats()["published"] == n, 10, "all routed")
        wait_for(
            lambda: (
                pub.stats()["subscribers"]["survivor"]["queue_depth"] == 0
                and pub.stats()["subscribers"]["survivor"]["inflight"] == 0
            ),
            20,
            "the survivor to drain",
        )
        stats = pub.stats()
        time.sleep(0.3)
        pub.close(timeout=5)
        alive = survivor.results(1)["survivor"]
    finally:
        pub.close(timeout=1)
        victim.kill()
        survivor.kill()
    dead = next(d for d in stats["departed"] if d["name"] == "victim")
    assert dead["reason"] == "disconnected" and dead["sent"] > 0
    assert alive["steps"] == sorted(set(alive["steps"])) and alive["missed"] == 0
    # Every message went to exactly one member: the survivor's, plus what the victim
    # was sent or still held (counted as dropped when it died).
    assert alive["received"] + dead["routed"] == n
    assert dead["routed"] == dead["sent"] + sum(dead["dropped"].values())
    g = stats["groups"]["g"]
    assert g["members"] == 1 and g["routed"] == n
    assert g["lost_inflight"] == dead["unacked_at_exit"]


def test_a_mark_reaches_every_subscriber_and_bad_ones_are_counted(publisher, address):
    """A probe marks a request; every subscriber (the sink among them) hears of it."""
    with (
        Subscriber(address, Subscription(name="probe")) as probe,
        Subscriber(address, Subscription(name="sink")) as sink,
    ):
        probe.wait_welcome(10)
        sink.wait_welcome(10)
        probe.mark("req-7", sample_index=1, reason="probe>0.9")
        probe._send([b"M", b"\x81\xa1x\x01"])  # a MARK without a request_id

        def mark_of(sub: Subscriber) -> dict:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                out = sub.recv(timeout=0.2)
                if getattr(out, "kind", None) == "mark":
                    return out.body
            raise TimeoutError("no mark arrived")

        for sub in (probe, sink):
            body = mark_of(sub)
            assert (body["request_id"], body["sample_index"]) == ("req-7", 1)
            assert (body["reason"], body["by"]) == ("probe>0.9", "probe")
        wait_for(lambda: publisher.stats()["rejected"] >= 1, 10, "the bad MARK counted")
        assert publisher.stats()["marks"] == 1
