"""10,000 fuzzed, truncated and oversized messages at each end of the bus.

Every injected message is invalid by construction (so the expected count is exact):
each must be rejected and counted, neither side may crash, and the good traffic
around them must flow untouched.
"""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from actbus.bus import Batch, Publisher, Subscriber, Subscription
from actbus.bus.publisher import MAX_CONTROL_BYTES
from actbus.wire import (
    BYE,
    CREDIT,
    DATA,
    END,
    HEARTBEAT,
    HELLO,
    KEEPALIVE,
    SCHEMA_VERSION,
    STATS,
    WELCOME,
    pack_seq,
)
from tests.support.bus_procs import message
from tests.support.procs import wait_for

N_BAD = 10_000
NEVER = b"\xc1"  # the one byte msgpack never uses: a body starting with it never decodes
CONTROL_TAGS = [HELLO, CREDIT, KEEPALIVE, STATS, BYE]
HELLO_BODY = msgpack.packb({"schema": SCHEMA_VERSION, "policy": "block", "name": "x" * 40})


def _noise(rng: np.random.Generator, lo: int = 0, hi: int = 64) -> bytes:
    return rng.integers(0, 256, int(rng.integers(lo, hi)), dtype=np.uint8).tobytes()


def _bad_control(rng: np.random.Generator) -> list[bytes]:
    """One control message (frames after the identity) that breaks the schema."""
    kind = int(rng.integers(0, 9))
    tag = CONTROL_TAGS[int(rng.integers(0, len(CONTROL_TAGS)))]
    if kind == 0:  # wrong frame count
        return [_noise(rng, 1) for _ in range([1, 3, 4][int(rng.integers(0, 3))])]
    if kind == 1:  # unknown tag, valid body
        return [b"Z" + _noise(rng), msgpack.packb({"acked": 1})]
    if kind == 2:  # undecodable body
        return [tag, NEVER + _noise(rng)]
    if kind == 3:  # truncated HELLO
        return [HELLO, HELLO_BODY[: int(rng.integers(1, len(HELLO_BODY)))]]
    if kind == 4:  # not a map
        return [tag, msgpack.packb([1, 2, 3])]
    if kind == 5:  # HELLO with a field of the wrong type or range
        field, value = [
            ("window", "many"),
            ("window", 0),
            ("policy", "newest"),
            ("layers", "all"),
            ("tags", ["x"]),
            ("spill_mb", -1),
            ("schema", SCHEMA_VERSION + 7),
        ][int(rng.integers(0, 7))]
        return [HELLO, msgpack.packb({"schema": SCHEMA_VERSION, field: value})]
    if kind == 6:  # CREDIT with a bad acknowledgement
        return [CREDIT, msgpack.packb({"acked": [-1, "x", None, 1.5][int(rng.integers(0, 4))]})]
    if kind == 7:  # KEEPALIVE naming nobody properly
        return [KEEPALIVE, msgpack.packb({"of": "not-bytes"})]
    return [tag, msgpack.packb({1: 2}, strict_types=False)]  # non-string keys


def test_fuzz_the_publisher(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1)
    sub = Subscriber(address, Subscription(window=8, name="good"))
    ctx = zmq.Context()
    try:
        sub.wait_welcome(10)
        n_good = 200
        got: list[int] = []

        def read():
            deadline = time.monotonic() + 30
            while len(got) < n_good and time.monotonic() < deadline:
                out = sub.recv(timeout=0.2)
                if isinstance(out, Batch):
                    got.append(out.step)

        reader = threading.Thread(target=read)
        reader.start()
        fuzz = ctx.socket(zmq.DEALER)
        fuzz.setsockopt(zmq.LINGER, 0)
        fuzz.setsockopt(zmq.SNDHWM, 0)
        fuzz.connect(address)
        rng = np.random.default_rng(4)
        for i in range(N_BAD):
            fuzz.send_multipart(_bad_control(rng))
            if i % (N_BAD // n_good) == 0:  # good traffic in between
                pub.publish(*message(i // (N_BAD // n_good)))
        wait_for(lambda: pub.stats()["rejected"] == N_BAD, 20, "every bad message counted")
        reader.join(timeout=30)
        assert got == list(range(n_good)) and sub.stats.missed == 0
        time.sleep(0.3)  # nothing more trickles in: the count is exact
        assert pub.stats()["rejected"] == N_BAD
        fuzz.close()

        # Oversized: libzmq refuses the frame before allocating it and closes that
        # connection; each one is counted as a closed connection.
        wait_for(lambda: pub.stats().get("connections_closed", 0) >= 1, 10, "fuzzer gone")
        base = pub.stats()["connections_closed"]
        for i in range(3):
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection, one count
            big.connect(address)
            big.send_multipart([HELLO, bytes(MAX_CONTROL_BYTES + 1 + i * (8 << 20))])
            wait_for(
                lambda i=i: pub.stats()["connections_closed"] == base + i + 1,
                10,
                "the oversized sender cut off",
            )
            big.close()
        assert pub.stats()["subscribers"].keys() == {"good"}  # nobody slipped in
        pub.publish(*message(n_good))
        after = None
        deadline = time.monotonic() + 10
        while not isinstance(after, Batch) and time.monotonic() < deadline:
            after = sub.recv(timeout=0.2)
        assert isinstance(after, Batch) and after.step == n_good
    finally:
        sub.close()
        pub.close(timeout=1)
        ctx.term()


def _good_data(seq: int) -> list[bytes]:
    hdr, t = message(seq, rows=2, hidden=16)
    return [DATA, pack_seq(seq), hdr.encode(), t.numpy().tobytes()]


def _bad_from_publisher(rng: np.random.Generator, good: list[bytes]) -> list[bytes]:
    """One publisher -> subscriber message that breaks the schema."""
    _, seq, header, tensor = good
    kind = int(rng.integers(0, 10))
    if kind == 0:  # wrong frame count for data
        return [DATA, seq, header, tensor, tensor][: [1, 2, 3, 5][int(rng.integers(0, 4))]]
    if kind == 1:  # bad sequence frame
        return [DATA, seq[: int(rng.integers(0, 8))], header, tensor]
    if kind == 2:  # truncated header
        return [DATA, seq, header[: int(rng.integers(1, len(header)))], tensor]
    if kind == 3:  # garbage header
        return [DATA, seq, NEVER + _noise(rng), tensor]
    if kind == 4:  # tensor truncated or oversized against the header
        cut = int(rng.integers(0, len(tensor)))
        return [DATA, seq, header, tensor[:cut] if rng.integers(0, 2) else tensor + tensor]
    if kind == 5:  # another schema version
        d = msgpack.unpackb(header)
        d["schema"] = SCHEMA_VERSION + 1
        return [DATA, seq, msgpack.packb(d), tensor]
    if kind == 6:  # header whose shape disagrees with its rows
        d = msgpack.unpackb(header)
        d["shape"] = [int(rng.integers(3, 99)), 16]
        return [DATA, seq, msgpack.packb(d), tensor]
    if kind == 7:  # control message with an undecodable body
        tag = [HEARTBEAT, WELCOME, STATS, END][int(rng.integers(0, 4))]
        return [tag, NEVER + _noise(rng)]
    if kind == 8:  # heartbeat with fields of the wrong type
        return [HEARTBEAT, msgpack.packb({"step": "x", "seq": [], "you": 3})]
    return [b"?" + _noise(rng, 0, 4), msgpack.packb({})]  # unknown tag


@pytest.mark.timeout(120)
def test_fuzz_the_subscriber(tmp_path):
    """A raw ROUTER poses as the publisher and mixes bad messages into good data."""
    address = f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.setsockopt(zmq.SNDHWM, 0)
    fake.bind(address)
    sub = Subscriber(address, Subscription(window=1 << 20, name="victim"), silence_s=60)
    try:
        ident = None
        deadline = time.monotonic() + 10
        while ident is None:
            assert fake.poll(int(max(0, deadline - time.monotonic()) * 1000)), "no HELLO"
            frames = fake.recv_multipart()
            if frames[1] == HELLO:
                ident = frames[0]
        welcome = {"schema": SCHEMA_VERSION, "publisher_id": "fake", "heartbeat_s": 5.0}
        fake.send_multipart([ident, WELCOME, msgpack.packb({**welcome, "next_seq": 0})])
        rng = np.random.default_rng(7)
        n_good = 200
        for i in range(N_BAD):
            if i % (N_BAD // n_good) == 0:
                fake.send_multipart([ident, *_good_data(i // (N_BAD // n_good))])
            good = _good_data(int(rng.integers(0, 1000)))
            fake.send_multipart([ident, *_bad_from_publisher(rng, good)])
        got: list[Batch] = []
        deadline = time.monotonic() + 60
        while (len(got) < n_good or sub.stats.rejected < N_BAD) and time.monotonic() < deadline:
            out = sub.recv(timeout=0.2)
            if isinstance(out, Batch):
                got.append(out)
    finally:
        sub.close()
        fake.close()
        ctx.term()
    assert sub.stats.rejected == N_BAD
    assert [b.seq for b in got] == list(range(n_good)) and sub.stats.missed == 0
    assert all(float(b.tensor[0, 0]) == b.step for b in got)
