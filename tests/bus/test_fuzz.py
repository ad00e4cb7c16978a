"""10,000 fuzzed, truncated and oversized messages at each end of the bus.

Every injected message is invalid by construction (so the expected count is exact):
each must be rejected and counted, neither side may crash, and the good traffic
around them must flow untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from actbus.bus import Batch, Publisher, Subscriber, Subscription
from actbus.bus.publisher import MAX_SESSION_BYTES, STATS_INTERVAL_S
from actbus.wire import (
    BYE,
    CREDIT,
    DATA,
    END,
    HEARTBEAT,
    HELLO,
    KEEPALIVE,
    REJECT,
    SCHEMA_VERSION,
    STATS,
    WELCOME,
    pack_seq,
)
from tests.support.bus_procs import ROOT, Proc, message
from tests.support.procs import wait_for

N_BAD = 10_000
NEVER = b"\xc1"  # the one byte msgpack never uses: a body starting with it never decodes
SESSION_TAGS = [HELLO, CREDIT, KEEPALIVE, STATS, BYE]
HELLO_BODY = msgpack.packb({"schema": SCHEMA_VERSION, "policy": "block", "name": "x" * 40})


def _noise(rng: np.random.Generator, lo: int = 0, hi: int = 64) -> bytes:
    return rng.integers(0, 256, int(rng.integers(lo, hi)), dtype=np.uint8).tobytes()


def _bad_session(rng: np.random.Generator) -> list[bytes]:
    """One session message (frames after the identity) that breaks the schema."""
    kind = int(rng.integers(0, 9))
    tag = SESSION_TAGS[int(rng.integers(0, len(SESSION_TAGS)))]
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
            fuzz.send_multipart(_bad_session(rng))
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
            big.send_multipart([HELLO, bytes(MAX_SESSION_BYTES + 1 + i * (8 << 20))])
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
    return [DATA, pack_seq(seq, bytes(8)), hdr.encode(), t.numpy().tobytes()]


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
    if kind == 7:  # session message with an undecodable body
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


# --------------------------------------------------------------- hostile peers
# Each attack class of issue 16 against a live publisher in its own process (so its
# memory and its log are its own), beside a `block` subscriber that must not notice.
RSS_BOUND = 100 << 20
LOG_BOUND = 16 << 10
MAX_WINDOW_MB = 4
MAX_SUBSCRIBERS = 64
N_IDLE = 100
IDLE_NAME = "idle-" + "x" * 195  # the longest name a HELLO keeps


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def _hello(**fields) -> list[bytes]:
    hello = {"schema": SCHEMA_VERSION, "policy": "drop_newest", "window_bytes": 1 << 20}
    return [HELLO, msgpack.packb({**hello, **fields})]


def _bombs() -> list[list[bytes]]:
    """Session messages made to cost the decoder: each must be refused, cheaply."""
    wide = {f"k{i}": i for i in range(4000)}  # a valid map of thousands of keys
    return [
        [HELLO, b"\x91" * 50_000 + b"\xc0"],  # nested 50,000 deep
        [HELLO, b"\xdd\xff\xff\xff\xff"],  # an array claiming 4 billion items
        [CREDIT, b"\xdb\xff\xff\xff\xff" + b"x" * 16],  # a string claiming 4 GiB
        [HELLO, b"\xde\xff\xff" + b"\xc0" * 64],  # a map claiming 65,535 pairs
        [STATS, b"\xc7\x05\x01abcde"],  # an extension type, not a map
        [HELLO, msgpack.packb(wide)],  # no schema among 4,000 keys
        [CREDIT, msgpack.packb({"acked": float("nan")})],
        [CREDIT, msgpack.packb({"acked": -(1 << 63)})],
    ]


class _Lines:
    """A process's stdout lines, read in the background."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.q.put(line.rstrip("\n"))

    def line(self, timeout: float) -> str:
        return self.q.get(timeout=timeout)


class _Memory:
    """Samples a process's RSS; kills it at once if it grows past the bound, so
    a leak fails the test in a second instead of filling the machine."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.base = _rss(popen.pid)
        self.peak = self.base
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05) and self.popen.poll() is None:
            with contextlib.suppress(OSError, RuntimeError):
                self.peak = max(self.peak, _rss(self.popen.pid))
            if self.peak - self.base > RSS_BOUND:
                self.popen.kill()
                return

    @property
    def grown(self) -> int:
        return self.peak - self.base


def _reply(sock: zmq.Socket, timeout: float = 10.0) -> tuple[bytes, dict]:
    """The reply to a HELLO: the first message after it."""
    assert sock.poll(int(timeout * 1000)), "no reply from the publisher"
    tag, body = sock.recv_multipart()
    return tag, msgpack.unpackb(body)


@pytest.mark.timeout(180)
def test_hostile_peers_beside_a_block_subscriber(tmp_path):
    """Acks beyond what was sent, huge windows, peers that never read, a huge filter,
    many idle subscribers, STATS probing, random frames and msgpack bombs, all at
    once: the block subscriber gets every message in order, the publisher's RSS
    grows by less than 100 MB, its thread lives, and its log stays small."""
    address = f"ipc://{tmp_path}/bus.sock"
    log_path = tmp_path / "publisher.log"
    with open(log_path, "wb") as log_file:
        args = [address, "90", str(MAX_WINDOW_MB), str(MAX_SUBSCRIBERS)]
        popen = subprocess.Popen(
            [sys.executable, "-m", "tests.support.bounded_publisher", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    out = _Lines(popen)
    good = Proc("subscribers", address, f"good:block:0:64/{MAX_WINDOW_MB}")
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []

    def dealer(ident: bytes, rcvhwm: int = 1) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, rcvhwm)  # a peer that does not read holds little itself
        s.setsockopt(zmq.SNDTIMEO, 5000)  # a publisher gone (killed at the bound) ends it
        s.setsockopt(zmq.ROUTING_ID, ident)
        s.connect(address)
        socks.append(s)
        return s

    memory = presser = None
    try:
        good.ready(1)
        assert out.line(60) == "ready"
        time.sleep(1.0)  # warmed up: the queue is full and flowing
        memory = _Memory(popen)

        # Huge windows: refused, naming the bound; then it acks beyond what was sent.
        huge = dealer(b"\x00huge")
        huge.send_multipart(_hello(window=1 << 20, window_bytes=1 << 40, name="huge"))
        tag, body = _reply(huge)
        assert tag == REJECT and "window must be an int in 1..1024" in body["reason"]
        huge.send_multipart(_hello(window=1024, window_bytes=1 << 40, name="huge"))
        tag, body = _reply(huge)
        assert tag == REJECT and "actbus.max_window_mb" in body["reason"], body

        # Peers that never read: one acks far beyond what was sent, one guesses. From
        # here on a thread of their own keeps them (and the refused one) acknowledging,
        # and sends random frames and bombs.
        window = {"window": 1024, "window_bytes": MAX_WINDOW_MB << 20}
        acker = dealer(b"\x00acker")
        acker.send_multipart(_hello(**window, name="acker"))
        guesser = dealer(b"\x00guesser")
        guesser.send_multipart(_hello(**window, name="guesser"))
        assert _reply(acker)[0] == WELCOME and _reply(guesser)[0] == WELCOME
        fuzz = dealer(b"\x00fuzz")
        stop = threading.Event()
        n_bad = 0

        def pressure() -> None:
            nonlocal n_bad
            rng = np.random.default_rng(16)
            guess = 0
            while not stop.wait(0.02) and popen.poll() is None:
                for _ in range(200):
                    fuzz.send_multipart(_bad_session(rng))
                for frames in _bombs():
                    fuzz.send_multipart(frames)
                n_bad += 200 + len(_bombs())
                acker.send_multipart([CREDIT, msgpack.packb({"acked": 1 << 40})])
                huge.send_multipart([CREDIT, msgpack.packb({"acked": 1 << 40})])
                guess += 64
                guesser.send_multipart([CREDIT, msgpack.packb({"acked": guess})])

        presser = threading.Thread(target=pressure)
        presser.start()

        # A filter far beyond the bound: refused, naming it.
        filt = dealer(b"\x00filter")
        wide = {f"k{k}": [f"value-{k}-{i}" for i in range(1000)] for k in range(3)}
        filt.send_multipart(_hello(tags=wide, name="filter"))
        tag, body = _reply(filt)
        assert tag == REJECT and "at most 8192" in body["reason"], body

        # STATS probing from a subscriber of its own (nameless: once keyed by identity).
        probe = dealer(b"\x00probe", rcvhwm=0)
        probe.send_multipart(_hello(layers=[], window=1))
        assert _reply(probe)[0] == WELCOME

        # Many idle subscribers: beyond the cap, refused naming it. Their identities
        # share a prefix longer than the 8 hex digits stats once keyed them by.
        idle = [dealer(b"\x00idle-peer" + i.to_bytes(4, "big")) for i in range(N_IDLE)]
        for i, s in enumerate(idle):
            s.send_multipart(_hello(window=1, layers=[] if i % 2 else None, name=IDLE_NAME))
        replies = [_reply(s) for s in idle]
        admitted = sum(tag == WELCOME for tag, _ in replies)
        refused = [body["reason"] for tag, body in replies if tag == REJECT]
        assert admitted + len(refused) == N_IDLE and admitted == MAX_SUBSCRIBERS - 4
        assert all("at most 64 subscribers" in r and "max_subscribers" in r for r in refused)

        # STATS: names only, each subscriber once, at most one answer per interval.
        t0 = time.monotonic()
        for _ in range(300):
            probe.send_multipart([STATS, msgpack.packb({})])
        stats_replies = []
        while time.monotonic() - t0 < 2.0:
            if probe.poll(100):
                tag, raw = probe.recv_multipart()
                if tag == STATS:
                    stats_replies.append(raw)
        assert 1 <= len(stats_replies) <= 2.0 / STATS_INTERVAL_S + 3
        subs = msgpack.unpackb(stats_replies[0])["subscribers"]
        names = [v["name"] for v in subs.values()]
        assert names.count(IDLE_NAME) == admitted  # none merged into another
        assert "good" in names and any(k.startswith("#") and not subs[k]["name"] for k in subs)
        for s in socks:
            ident = s.getsockopt(zmq.ROUTING_ID)
            assert all(
                ident not in raw and ident.hex().encode() not in raw for raw in stats_replies
            )

        time.sleep(8.0)  # the attacks go on
        stop.set()
        presser.join()
        assert memory.grown < RSS_BOUND, f"the publisher's RSS grew {memory.grown >> 20} MiB"
        popen.stdin.write("stop\n")  # publishing ends; the publisher reports and closes
        popen.stdin.flush()

        result = json.loads(out.line(60))
        good_result = good.results(1, timeout=60)["good"]
    finally:
        if presser is not None:
            stop.set()
            presser.join()
        if memory is not None:
            memory.stop.set()
        for s in socks:
            s.close()
        ctx.term()
        good.kill()
        if popen.poll() is None:
            popen.kill()
        popen.wait(timeout=30)
    assert memory.grown < RSS_BOUND, f"the publisher's RSS grew {memory.grown >> 20} MiB"
    assert result["alive"]
    st = result["stats"]
    assert st["rejected"] >= n_bad and st["subscribers_refused"] >= len(refused)
    n = result["published"]
    assert good_result["steps"] == list(range(n)) and good_result["seqs"] == list(range(n))
    assert good_result["missed"] == 0 and good_result["bad_values"] == 0
    assert good_result["ended"]
    log_bytes = log_path.stat().st_size
    assert log_bytes < LOG_BOUND, log_path.read_text()[-2000:]
