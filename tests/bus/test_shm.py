"""The shared-memory path: what subscribers on the publisher's host can and cannot do
to its region, and what is left when either side is killed (real processes)."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from actbus.bus import Batch, Publisher, Subscriber, Subscription
from actbus.bus.routing import PENDING_LIMIT
from actbus.bus.shm import DESCRIPTOR, HEADER_BYTES, Mapping, Region, host_facts
from actbus.wire import (
    CREDIT,
    HELLO,
    REGION,
    SCHEMA_VERSION,
    WELCOME,
    Header,
    RowIndex,
    pack_map,
    pack_seq,
)
from tests.support.bus_procs import Proc, message
from tests.support.procs import recv_batches, wait_for

MSG = 16 << 10  # bus_procs.message's bytes


@pytest.fixture
def publisher(address):
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1, shm_mb=4)
    yield pub
    pub.close(timeout=2)


def _dev_shm() -> set[str]:
    """actbus's names in /dev/shm (others' come and go on a shared machine)."""
    return {name for name in os.listdir("/dev/shm") if "actbus" in name}


def _region_maps() -> list[str]:
    """This process's mappings of a publisher's region."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "actbus-region" in line]


def _used(pub: Publisher) -> int:
    return pub.stats()["shm"]["used_bytes"]


def _blocks_back(pub: Publisher, *subs: Subscriber, most: int = 0) -> None:
    """Wait until the region holds at most ``most`` bytes, the subscribers reading on
    (and so acknowledging what they let go)."""

    def back() -> bool:
        for sub in subs:  # everything waiting (heartbeats come ten a second)
            while sub.recv(timeout=0.02) is not None:
                pass
        return _used(pub) <= most

    wait_for(back, 10, f"the region down to {most} bytes")


def test_a_region_is_private_sealed_read_only_and_never_named(publisher, address):
    """Mode 0600, never in /dev/shm; a subscriber maps it read-only, and even a peer
    of the same user cannot write it, map it writable or resize it."""
    before = _dev_shm()
    with (
        Subscriber(address, Subscription(name="local")) as sub,
        Subscriber(address, Subscription(name="far"), shm=False) as far,
    ):
        sub.wait_welcome(10)
        far.wait_welcome(10)
        publisher.publish(*message(7))
        (batch,) = recv_batches(sub, 1)
        (other,) = recv_batches(far, 1)
        assert float(batch.tensor[0, 0]) == 7 and float(other.tensor[0, 0]) == 7
        assert (sub.stats.path, far.stats.path) == ("shm", "socket")
        assert batch.shared and not other.shared and other.keep() is other.tensor
        kept = batch.keep()  # a private copy, to hold past the batch
        assert kept.data_ptr() != batch.tensor.data_ptr() and bool((kept == 7).all())
        subs = publisher.stats()["subscribers"]
        assert (subs["local"]["path"], subs["far"]["path"]) == ("shm", "socket")
        # This process maps it twice: the publisher's (rw) and the subscriber's (r).
        assert {line.split()[1] for line in _region_maps()} == {"r--s", "rw-s"}
        offer = sub.welcome["shm"]
        path = f"/proc/{offer['pid']}/fd/{offer['fd']}"
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, offer["size"])  # writable, shared
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", HEADER_BYTES)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, HEADER_BYTES)  # a shrunk region would SIGBUS its readers
        finally:
            os.close(fd)
        assert float(batch.tensor[0, 0]) == 7
    assert _dev_shm() == before


def test_a_view_is_never_reused_while_held_and_kept_batches_are_copied_out(publisher, address):
    """A held view keeps its block: 300 messages later, read by a subscriber beside it
    through the same region, it still reads its own rows; once let go, the blocks come
    back. Batches kept whole are copied out, so credit flows on."""
    keeper = Subscriber(address, Subscription(policy="drop_newest", window=4, name="keeper"))
    reader = Subscriber(address, Subscription(window=4, name="reader"))
    try:
        keeper.wait_welcome(10)
        reader.wait_welcome(10)
        publisher.publish(*message(0))
        (first,) = recv_batches(keeper, 1)
        row = first.tensor[0]  # a view of its own: holds the block whatever happens
        del first
        assert recv_batches(reader, 1)[0].step == 0
        got = []
        for step in range(1, 301):  # both read on: blocks are freed and taken again
            publisher.publish(*message(step))
            keeper.recv(timeout=0.001)  # what it reads beside the view it keeps, it drops
            out = reader.recv(timeout=0.001)
            if isinstance(out, Batch):
                got.append((out.step, float(out.tensor[-1, -1])))
        del out
        got += [(b.step, float(b.tensor[-1, -1])) for b in recv_batches(reader, 300 - len(got))]
        assert got == [(step, float(step)) for step in range(1, 301)]
        st = publisher.stats()  # more blocks than the region holds: reused around the view
        assert st["shm"]["blocks"] > st["shm"]["bytes"] // MSG
        assert st["subscribers"]["reader"]["shm_fallback"] == 0
        assert keeper.stats.path == "shm" and bool((row == 0).all())
        del row
        for step in range(301, 311):  # the keeper reads on; it kept nothing since
            publisher.publish(*message(step))
        kept = recv_batches(keeper, 10)  # kept whole: copied out as they hold credit back
        assert kept and keeper.stats.copied_out >= 1
        assert all(float(b.tensor[0, 0]) == b.step for b in kept)
        del kept
        _blocks_back(publisher, keeper, reader)
    finally:
        keeper.close()
        reader.close()


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def test_a_lying_subscriber_holds_no_more_than_its_window(publisher, address):
    """A local peer that never acknowledges, then acknowledges what it never got and
    without receipts: refused, and the region it holds stays within its window while
    a block subscriber beside it gets every message."""
    ctx = zmq.Context()
    liar = _dealer(ctx, address)
    hello = {"schema": SCHEMA_VERSION, "policy": "drop_newest", "window": 4, "name": "liar"}
    liar.send_multipart([HELLO, pack_map({**hello, "shm": {**host_facts(), "pid": os.getpid()}})])
    tag, body = liar.recv_multipart()
    assert tag == WELCOME and "shm" in msgpack.unpackb(body)
    try:
        with Subscriber(address, Subscription(window=8, name="good")) as good:
            good.wait_welcome(10)
            for step in range(200):
                publisher.publish(*message(step))
                if step % 50 == 0:
                    liar.send_multipart([CREDIT, pack_map({"acked": 10**6, "proof": b""})])
                    liar.send_multipart([CREDIT, pack_map({"acked": 3, "proof": b"x" * 8})])
            got = recv_batches(good, 200)
            assert [b.step for b in got] == list(range(200))
            del got
            # What it holds: its 4 unacknowledged messages and its memory queue, as
            # on the socket; nothing of what it dropped.
            _blocks_back(publisher, good, most=(4 + PENDING_LIMIT) * MSG)
            st = publisher.stats()
            assert st["rejected"] >= 8 and st["subscribers"]["liar"]["inflight"] == 4
            assert st["subscribers"]["liar"]["dropped"]["queue_full"] >= 150
    finally:
        liar.close()
        ctx.term()


def test_a_hostile_publisher_cannot_point_outside_its_region(address):
    """Descriptors out of the region or of another length than the header's are
    refused by name and counted; the subscriber reads on."""
    region = Region(1 << 20)
    rows = region.stage(message(5)[1])
    off = region.offset(rows)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    try:
        with Subscriber(address, Subscription(name="s")) as sub:
            ident, tag, _ = router.recv_multipart()
            assert tag == HELLO
            welcome = {"schema": SCHEMA_VERSION, "publisher_id": "p", "shm": region.offer()}
            router.send_multipart([ident, WELCOME, pack_map(welcome)])
            header = message(5)[0].encode()
            for seq, desc in enumerate(
                [
                    DESCRIPTOR.pack(region.size - 100, MSG),  # past the end
                    DESCRIPTOR.pack(0, MSG),  # the token page
                    DESCRIPTOR.pack(off, MSG - 4),  # not the header's length
                    DESCRIPTOR.pack(2**63, MSG),  # wraps
                    DESCRIPTOR.pack(off, MSG),
                ]
            ):
                router.send_multipart([ident, REGION, pack_seq(seq, b"p" * 8), header, desc])
            got = recv_batches(sub, 1)
            assert sub.stats.path == "shm" and len(got) == 1
            assert got[0].seq == 4 and float(got[0].tensor[3, 1023]) == 5
            assert sub.stats.rejected == 4
            assert sub.stats.rejected_by == {"descriptor": 3, "shape": 1}
    finally:
        router.close()
        ctx.term()
        region.close()


def test_nothing_is_left_when_the_publisher_is_killed(address):
    """kill -9 of the publisher's process: nothing in /dev/shm, the views held still
    read what was published, and the memory goes with the last of them."""
    before = _dev_shm()
    pub = Proc("publisher", address, "100")
    try:
        pub.ready(1)
        with Subscriber(address, Subscription(window=64, name="s")) as sub:
            sub.wait_welcome(30)
            kept = recv_batches(sub, 20)
            assert len(kept) == 20 and sub.stats.path == "shm" and _region_maps()
            pub.kill()
            assert _dev_shm() == before
            assert all(bool((b.tensor == b.step).all()) for b in kept)
        del kept, sub
        gc.collect()
        assert _region_maps() == []
    finally:
        pub.kill()


def test_a_killed_subscriber_gives_its_blocks_back(publisher, address):
    """kill -9 of a subscriber holding views: it is dropped, its blocks come back, the
    subscriber beside it reads on, and nothing is in /dev/shm."""
    before = _dev_shm()
    holder = Proc("holder", address, "10")
    try:
        with Subscriber(address, Subscription(window=8, name="good")) as good:
            good.wait_welcome(10)
            holder.ready(1)
            for step in range(10):
                publisher.publish(*message(step))
            assert holder.line(30) == "held 10 shm"
            assert len(recv_batches(good, 10)) == 10
            good.recv(timeout=0.2)
            assert _used(publisher) >= 10 * MSG  # the holder's
            holder.kill()
            wait_for(
                lambda: "holder" not in publisher.stats()["subscribers"], 10, "the holder dropped"
            )
            for step in range(10, 110):
                publisher.publish(*message(step))
                time.sleep(0.001)
            got = recv_batches(good, 100)
            assert [b.step for b in got] == list(range(10, 110))
            del got
            _blocks_back(publisher, good)
        assert _dev_shm() == before
    finally:
        holder.kill()


def test_a_subscriber_dropped_while_paused_still_reads_its_own_rows(address):
    """Paused past ``subscriber_timeout_s`` holding a view: the publisher drops it but
    retires its block rather than reuse it, so the engine's next copies land elsewhere
    and the view still reads 1.0, not 158.0. Resumed, it learns it was dropped
    (``evicted``), says it views nothing more (its batch copied out), and the block
    comes back."""
    pub = Publisher(
        address, info={"model": "t"}, heartbeat_s=0.1, subscriber_timeout_s=0.5, shm_mb=1
    )
    sub = Subscriber(address, Subscription(window=4, name="paused"), keepalive=False)
    try:
        sub.wait_welcome(10)
        pub.publish(*message(1))
        (batch,) = recv_batches(sub, 1)
        assert batch.shared
        wait_for(lambda: "paused" not in pub.stats()["subscribers"], 10, "the paused one dropped")
        fills = []  # the engine's next host copies: every block the region still gives
        while (t := pub.host_tensor((4, 1024), torch.float32)) is not None:
            fills.append(t.fill_(158.0))
        assert fills and bool((batch.tensor == 1.0).all())
        assert pub.stats()["shm"]["retired_blocks"] == 1
        del fills
        wait_for(
            lambda: (sub.recv(timeout=0.05), sub.stats.welcomes)[1] == 2, 10, "subscribed again"
        )
        assert sub.stats.evicted == 1 and bool((batch.tensor == 1.0).all())
        assert pub.stats()["shm"]["retired_blocks"] == 0
        pub.publish(*message(2))
        assert float(recv_batches(sub, 1)[0].tensor[0, 0]) == 2.0
    finally:
        sub.close()
        pub.close(timeout=2)


def test_a_stopped_subscribers_blocks_wait_for_its_process_to_exit(address):
    """SIGSTOP of a subscriber holding ten views: dropped at its timeout, its blocks
    stay retired (it may resume and read them); after kill -9 they come back."""
    pub = Publisher(
        address, info={"model": "t"}, heartbeat_s=0.1, subscriber_timeout_s=0.5, shm_mb=4
    )
    holder = Proc("holder", address, "10")
    try:
        holder.ready(1)
        for step in range(10):
            pub.publish(*message(step))
        assert holder.line(30) == "held 10 shm"
        os.kill(holder.popen.pid, signal.SIGSTOP)
        wait_for(lambda: "holder" not in pub.stats()["subscribers"], 10, "the holder dropped")
        assert pub.stats()["departed"][-1]["reason"] == "timeout"
        assert _used(pub) >= 10 * MSG and pub.stats()["shm"]["retired_blocks"] == 10
        holder.kill()
        wait_for(lambda: _used(pub) == 0, 10, "its blocks back once it exited")
        assert pub.stats()["shm"]["retired_released"] == 10
    finally:
        holder.kill()
        pub.close(timeout=2)


def test_a_filtered_subscriber_is_not_offered_the_region(publisher, address):
    """The region holds every request's rows: a subscriber whose filter cuts some out
    is not offered it (its mapping would show it the rows cut out), and reads its
    own, a copy, from the socket; an unfiltered one beside it reads the region."""
    ri = RowIndex(
        ["train-req", "eval-req"],
        np.array([0, 2, 4]),
        np.arange(4),
        np.arange(4),
        tags=[{"split": "train"}, {"split": "eval"}],
    )
    header = Header(0, 0, "post_block", "float32", (4, 1024), "test", ri)
    rows = torch.arange(4, dtype=torch.float32)[:, None].repeat(1, 1024)
    only = Subscriber(address, Subscription(match={"split": "train"}, name="train"))
    every = Subscriber(address, Subscription(name="every"))
    try:
        only.wait_welcome(10)
        every.wait_welcome(10)
        assert "shm" not in only.welcome and "shm" in every.welcome
        publisher.publish(header, rows)
        (mine,) = recv_batches(only, 1)
        (all_rows,) = recv_batches(every, 1)
        assert mine.header.rows.request_ids == ["train-req"] and not mine.shared
        assert mine.tensor[:, 0].tolist() == [0.0, 1.0]
        assert only.stats.path == "socket" and every.stats.path == "shm" and all_rows.shared
        st = publisher.stats()["subscribers"]
        assert st["train"]["path"] == "socket" and st["every"]["path"] == "shm"
    finally:
        only.close()
        every.close()


def test_a_view_kept_past_close_is_never_reused(publisher, address):
    """A consumer that keeps a view of its own (a row) past ``close``: the BYE says the
    subscriber still views that message, so its block is retired, not reused; the
    engine's next copies land elsewhere."""
    sub = Subscriber(address, Subscription(window=4, name="closer"))
    sub.wait_welcome(10)
    publisher.publish(*message(1))
    (batch,) = recv_batches(sub, 1)
    row = batch.tensor[0]  # a view of its own: close cannot copy it out
    del batch
    sub.close()
    wait_for(lambda: "closer" not in publisher.stats()["subscribers"], 10, "it left")
    fills = []
    while (t := publisher.host_tensor((4, 1024), torch.float32)) is not None:
        fills.append(t.fill_(158.0))
    assert fills and bool((row == 1.0).all())
    assert publisher.stats()["shm"]["retired_blocks"] == 1


def test_a_second_hello_keeps_the_blocks_of_what_was_sent(publisher, address):
    """A subscriber says HELLO again (it thought the publisher went quiet) while it
    views a message it has not acknowledged: its credit starts afresh, but the block
    stays held until it acknowledges that message; the engine's next copies land
    elsewhere."""
    ctx = zmq.Context()
    peer = _dealer(ctx, address)
    hello = pack_map(
        {
            "schema": SCHEMA_VERSION,
            "window": 4,
            "name": "again",
            "shm": {**host_facts(), "pid": os.getpid()},
        }
    )
    try:
        peer.send_multipart([HELLO, hello])
        tag, body = peer.recv_multipart()
        assert tag == WELCOME
        mapping = Mapping.attach(msgpack.unpackb(body)["shm"])
        publisher.publish(*message(1))
        while (frames := peer.recv_multipart())[0] != REGION:
            pass
        rows, _ = mapping.tensor(frames[3], Header.decode(frames[2]))
        peer.send_multipart([HELLO, hello])  # the same identity: a second HELLO
        while peer.recv_multipart()[0] != WELCOME:
            pass
        fills = []
        while (t := publisher.host_tensor((4, 1024), torch.float32)) is not None:
            fills.append(t.fill_(158.0))
        assert fills and bool((rows == 1.0).all())
    finally:
        peer.close()
        ctx.term()
