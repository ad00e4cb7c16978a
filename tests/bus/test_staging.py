"""Pinned staging memory: messages that wait in the publisher's queue leave it.

On CUDA the capture worker copies each step into torch's pinned-memory cache and
publishes it with the copy's event; a message that waits for a slow subscriber would
keep its block, and the engine's next step would miss the cache. The publisher's
thread copies such waiting messages into ordinary memory once their copy is done
(``Publisher._unpin_backlog``). There is no GPU here, so ``CopyDone`` stands in for
the CUDA event (the two calls the publisher makes of it); sockets, threads and the
subscriber are the real ones.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from actbus.bus import Publisher, Subscriber, Subscription
from actbus.wire import Header, RowIndex
from tests.support.procs import recv_batches, wait_for

ROWS, HIDDEN = 64, 512  # 128 KiB a message: above zmq's copy threshold, sent zero-copy


class CopyDone:
    """A device-to-host copy's completion, as the publisher asks it (``query``,
    ``synchronize``); ``land`` is the copy finishing."""

    def __init__(self, done: bool = True) -> None:
        self._e = threading.Event()
        if done:
            self._e.set()

    def query(self) -> bool:
        return self._e.is_set()

    def synchronize(self) -> None:
        assert self._e.wait(10), "the copy never landed"

    def land(self) -> None:
        self._e.set()


@pytest.fixture
def publisher(address):
    pub = Publisher(address, info={"model": "test"}, queue_bytes=64 << 20, heartbeat_s=0.1)
    yield pub
    pub.close(timeout=2)


def _msg(step: int) -> tuple[Header, torch.Tensor]:
    toks = np.arange(ROWS, dtype=np.int64) + 1000 * step
    ri = RowIndex(["r"], np.array([0, ROWS]), np.arange(ROWS), toks[:])  # a view, as on CUDA
    hdr = Header(step, 0, "post_block", "float32", (ROWS, HIDDEN), "test", ri)
    return hdr, torch.full((ROWS, HIDDEN), float(step))


def _check(got, steps) -> None:
    assert [b.step for b in got] == list(steps)
    for b in got:
        assert torch.equal(b.tensor, torch.full((ROWS, HIDDEN), float(b.step)))
        assert b.header.rows.token_ids.tolist() == list(range(1000 * b.step, 1000 * b.step + ROWS))


def test_messages_waiting_for_a_slow_subscriber_leave_pinned_memory(publisher, address):
    n = 40
    staged = []  # the staging memory of each message: its rows and its token ids
    with Subscriber(address, Subscription(window=2, name="slow")) as sub:
        sub.wait_welcome(10)
        for i in range(n):
            hdr, t = _msg(i)
            staged += [weakref.ref(t), weakref.ref(hdr.rows.token_ids.base)]
            publisher.publish(hdr, t, ready=CopyDone())
            del hdr, t

        def settled() -> bool:  # every message routed to it or moved out of staging
            st = publisher.stats()
            return st["unpinned"] > 0 and st["queued"] == st["unpinned"]

        wait_for(settled, 10, "the queued backlog moved out of staging memory")
        st = publisher.stats()
        # What was routed (sent within its credit, or in its own queue) was not copied.
        routed = st["subscribers"]["slow"]["sent"] + st["subscribers"]["slow"]["pending"]
        assert st["unpinned"] == n - routed and 0 < routed <= 2 + 8
        gc.collect()  # what the publisher still holds of its staging memory: the routed
        assert sum(r() is not None for r in staged) <= 2 * routed
        _check(recv_batches(sub, n), range(n))  # the copies are the messages, bit for bit


def test_a_message_is_not_copied_before_its_device_copy_lands(publisher, address):
    with Subscriber(address, Subscription(window=2, name="slow")) as sub:
        sub.wait_welcome(10)
        for i in range(12):  # past its credit and its queue: the rest waits in the queue
            publisher.publish(*_msg(i), ready=CopyDone())

        def settled() -> bool:
            st = publisher.stats()
            return st["queued"] == st["unpinned"] > 0

        wait_for(settled, 10, "the queued backlog moved out of staging memory")
        moved = publisher.stats()["unpinned"]
        hdr, t = _msg(12)
        t.fill_(-1.0)  # what the staging block holds before the copy lands
        copy = CopyDone(done=False)
        publisher.publish(hdr, t, ready=copy)
        time.sleep(0.5)  # five heartbeat turns of the publisher's thread
        st = publisher.stats()
        assert (st["unpinned"], st["queued"]) == (moved, moved + 1)
        t.fill_(12.0)  # the copy lands
        copy.land()
        _check(recv_batches(sub, 13), range(13))


def test_a_subscriber_that_keeps_up_costs_no_copy(publisher, address):
    with Subscriber(address, Subscription(window=8, name="fast")) as sub:
        sub.wait_welcome(10)
        got = []
        for i in range(30):
            publisher.publish(*_msg(i), ready=CopyDone())
            got += recv_batches(sub, 1)
        _check(got, range(30))
        assert publisher.stats()["unpinned"] == 0
