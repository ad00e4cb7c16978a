"""Fan-in over real sockets: one consumer, several publishers (``actbus.bus.fanin``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from actbus.bus import Batch, Event, Publisher, Subscriber, Subscription
from actbus.bus.endpoints import Endpoints
from actbus.bus.fanin import FanIn, subscribe
from actbus.errors import ConfigError
from actbus.wire import Header, RowIndex
from tests.support.bus_procs import Proc


def _msg(step: int, rid: str = "r", rows: int = 4, hidden: int = 64):
    ri = RowIndex([rid], np.array([0, rows]), np.arange(rows), np.arange(rows))
    hdr = Header(step, 0, "post_block", "float32", (rows, hidden), "test", ri)
    return hdr, torch.full((rows, hidden), float(step))


def _pub(address: str) -> Publisher:
    return Publisher(address, info={"model": "test"}, heartbeat_s=0.1, subscriber_timeout_s=30)


def _read_until(fi: FanIn, done, timeout: float, on=None) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out; counters {fi.per_publisher()}"
        out = fi.recv(timeout=0.5)
        if out is not None and on is not None:
            on(out)


def _welcomed(fi: FanIn) -> int:
    return sum(s.welcome is not None for s in fi.publishers.values())


# ---------------------------------------------------------------- --connect
def test_connect_spellings(tmp_path):
    one = Endpoints.parse(f"ipc://{tmp_path}/a.sock")
    assert not one.fan_in and one.addresses == (f"ipc://{tmp_path}/a.sock",)
    ranged = Endpoints.parse(f"ipc://{tmp_path}/a-{{0..2}}.sock,tcp://127.0.0.1:{{5555..5556}}")
    assert ranged.fan_in and ranged.addresses == (
        f"ipc://{tmp_path}/a-0.sock",
        f"ipc://{tmp_path}/a-1.sock",
        f"ipc://{tmp_path}/a-2.sock",
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:5556",
    )
    f = tmp_path / "endpoints.txt"
    f.write_text(f"# the fleet\nipc://{tmp_path}/x.sock\n\ntcp://127.0.0.1:{{7000..7001}}  # two\n")
    listed = Endpoints.parse(f"@{f}")
    assert listed.fan_in and listed.current() == [
        f"ipc://{tmp_path}/x.sock",
        "tcp://127.0.0.1:7000",
        "tcp://127.0.0.1:7001",
    ]
    bad = {
        f"ipc://{tmp_path}/a-{{3..1}}.sock": "runs backwards",
        f"ipc://{tmp_path}/{{0..1}}-{{0..1}}": "one {A..B} range",
        f"ipc://{tmp_path}/a.sock,,ipc://{tmp_path}/b.sock": "empty item",
        f"ipc://{tmp_path}/a.sock,ipc://{tmp_path}/a.sock": "listed twice",
        f"ipc://{tmp_path}/{{x}}.sock": "{FIRST..LAST}",
        "tcp://127.0.0.1:{0..99999}": "at most",
        f"@{tmp_path}/missing.txt": "cannot read the endpoints file",
        "tcp://host": "not a ZeroMQ address",
    }
    for spec, why in bad.items():
        with pytest.raises(ConfigError, match="--connect") as e:
            Endpoints.parse(spec)
        assert why in str(e.value), (spec, str(e.value))
    f.write_text("ipc:///tmp/ok.sock\nnot-an-address\n")
    with pytest.raises(ConfigError, match="line 2"):
        Endpoints.parse(f"@{f}")


def test_one_address_stays_a_plain_subscriber(tmp_path):
    with subscribe(f"ipc://{tmp_path}/a.sock", Subscription(name="one")) as s:
        assert type(s) is Subscriber


# ---------------------------------------------------------------- delivery
@pytest.mark.usefixtures("bus_path")
def test_two_publishers_each_message_once_and_in_order(tmp_path):
    addrs = [f"ipc://{tmp_path}/p{i}.sock" for i in range(2)]
    pubs = [_pub(a) for a in addrs]
    n = 300
    got: dict[str, list[tuple[int, int, float]]] = {a: [] for a in addrs}
    try:
        with FanIn(",".join(addrs), Subscription(window=4, name="fan")) as fi:
            _read_until(fi, lambda: _welcomed(fi) == 2, 20)
            feeders = [
                threading.Thread(
                    target=lambda p=p, k=k: [p.publish(*_msg(1000 * k + i)) for i in range(n)],
                    daemon=True,
                )
                for k, p in enumerate(pubs)
            ]
            for t in feeders:
                t.start()

            def on(out):
                if isinstance(out, Batch):
                    got[out.source.address].append((out.seq, out.step, float(out.tensor[0, 0])))

            _read_until(fi, lambda: sum(map(len, got.values())) == 2 * n, 30, on)
            for t in feeders:
                t.join(timeout=10)
            per = fi.per_publisher()
            assert fi.stats.received == 2 * n and fi.stats.missed == 0
    finally:
        for p in pubs:
            p.close(timeout=2)
    for k, a in enumerate(addrs):
        assert [s for s, _, _ in got[a]] == list(range(n))  # in order, each once
        assert [st for _, st, _ in got[a]] == [1000 * k + i for i in range(n)]
        assert all(v == st for _, st, v in got[a])
        assert per[a]["received"] == n and per[a]["missed"] == 0
        assert per[a]["publisher_id"] == pubs[k].id


@pytest.mark.usefixtures("bus_path")
def test_end_comes_once_every_publisher_ended(tmp_path):
    addrs = [f"ipc://{tmp_path}/p{i}.sock" for i in range(2)]
    pubs = [_pub(a) for a in addrs]
    with FanIn(",".join(addrs), Subscription(name="fan")) as fi:
        _read_until(fi, lambda: _welcomed(fi) == 2, 20)
        kinds: list[str] = []
        pubs[0].close(timeout=2)
        _read_until(fi, lambda: "left" in kinds, 10, lambda o: kinds.append(getattr(o, "kind", "")))
        assert "end" not in kinds
        pubs[1].close(timeout=2)
        _read_until(fi, lambda: "end" in kinds, 10, lambda o: kinds.append(getattr(o, "kind", "")))


# ---------------------------------------------------------------- faults
def test_kill9_of_one_publisher_does_not_stall_the_other_and_a_restart_is_taken_up(tmp_path):
    a, b = (f"ipc://{tmp_path}/{n}.sock" for n in "ab")
    procs = {a: Proc("publisher", a, "200"), b: Proc("publisher", b, "200")}
    first_id = procs[a].ready(1)[0]
    procs[b].ready(1)
    seen: dict[str, list[Batch]] = {a: [], b: []}
    runs_of_a: list[str | None] = []
    try:
        with FanIn(f"{a},{b}", Subscription(window=8, name="fan"), silence_s=1.0) as fi:

            def on(out):
                if isinstance(out, Batch):
                    seen[out.source.address].append(out)
                elif out.kind == "welcome" and out.source.address == a:
                    runs_of_a.append(out.source.publisher_id)

            _read_until(fi, lambda: min(len(seen[a]), len(seen[b])) >= 50, 30, on)
            procs[a].kill()  # SIGKILL: no goodbye
            b_at_kill = len(seen[b])
            _read_until(fi, lambda: fi.publishers[a].stats.lost == 1, 20, on)
            _read_until(fi, lambda: len(seen[b]) >= b_at_kill + 200, 20, on)
            a_before = len(seen[a])
            procs[a] = Proc("publisher", a, "200")
            second_id = procs[a].ready(1)[0]
            _read_until(fi, lambda: len(seen[a]) >= a_before + 50, 30, on)
            per = fi.per_publisher()
    finally:
        for p in procs.values():
            p.kill()
    # b: no gap, all the while
    assert [x.seq for x in seen[b]] == list(range(seen[b][0].seq, seen[b][0].seq + len(seen[b])))
    assert per[b]["lost"] == 0 and per[b]["missed"] == 0
    # a: reported lost once, its new run taken up and told apart
    assert per[a]["lost"] == 1 and second_id != first_id
    assert runs_of_a == [first_id, second_id]
    old, new = seen[a][:a_before], seen[a][a_before:]
    assert {x.source.publisher_id for x in old} == {first_id}
    assert {x.source.publisher_id for x in new} == {second_id}
    assert new[0].seq == 0 and [x.seq for x in new] == list(range(len(new)))


def test_endpoints_file_edited_to_add_a_publisher(tmp_path):
    addrs = [f"ipc://{tmp_path}/p{i}.sock" for i in range(3)]
    listing = tmp_path / "endpoints.txt"
    listing.write_text("\n".join(addrs[:2]) + "\n")
    pubs = [_pub(a) for a in addrs]
    seen: dict[str, int] = {}

    def on(out):
        if isinstance(out, Batch):
            seen[out.source.address] = seen.get(out.source.address, 0) + 1

    stop = threading.Event()

    def feed():
        step = 0
        while not stop.is_set():
            for p in pubs:
                p.publish(*_msg(step))
            step += 1
            time.sleep(0.005)

    feeder = threading.Thread(target=feed, daemon=True)
    try:
        with FanIn(f"@{listing}", Subscription(window=8, policy="drop_oldest", name="fan")) as fi:
            assert list(fi.publishers) == addrs[:2]
            feeder.start()
            _read_until(fi, lambda: len(seen) == 2 and min(seen.values()) >= 20, 20, on)
            assert addrs[2] not in seen
            listing.write_text("\n".join(addrs) + "\n")  # the fleet grows
            _read_until(fi, lambda: seen.get(addrs[2], 0) >= 20, 20, on)
            listing.write_text("\n".join(addrs[1:]) + "\n")  # and shrinks
            _read_until(fi, lambda: addrs[0] not in fi.publishers, 10, on)
            assert fi.stats.received >= sum(seen.values())  # a retired one still counts
    finally:
        stop.set()
        feeder.join(timeout=10)
        for p in pubs:
            p.close(timeout=2)


def test_two_publishers_two_group_members_share_the_tokens(tmp_path):
    addrs = [f"ipc://{tmp_path}/p{i}.sock" for i in range(2)]
    pubs = [_pub(a) for a in addrs]
    n = 200
    tokens: dict[str, list[tuple[str, int]]] = {"m0": [], "m1": []}
    ready = threading.Barrier(3, timeout=30)
    errors: list[BaseException] = []

    def member(name: str) -> None:
        try:
            with FanIn(",".join(addrs), Subscription(window=4, group="g", name=name)) as fi:
                _read_until(fi, lambda: _welcomed(fi) == 2, 20)
                ready.wait()
                ended = []

                def on(out):
                    if isinstance(out, Batch):
                        tokens[name].append((out.source.address, out.step))
                        time.sleep(0.001)  # some work: the group shares it out
                    elif isinstance(out, Event) and out.kind == "end":
                        ended.append(True)

                _read_until(fi, lambda: bool(ended), 60, on)
        except BaseException as e:
            errors.append(e)

    members = [threading.Thread(target=member, args=(m,), daemon=True) for m in tokens]
    for t in members:
        t.start()
    ready.wait()
    time.sleep(0.3)  # both members are in the group at both publishers
    for p in pubs:
        for i in range(n):
            p.publish(*_msg(i))
    for p in pubs:
        p.close(timeout=10)
    for t in members:
        t.join(timeout=60)
    assert not errors, errors
    a, b = set(tokens["m0"]), set(tokens["m1"])
    assert len(a) == len(tokens["m0"]) and len(b) == len(tokens["m1"])  # none twice
    assert not a & b  # disjoint
    assert a | b == {(addr, i) for addr in addrs for i in range(n)}  # together complete
    assert a and b  # both had a share


def test_run_of_a_consumer_reports_each_publisher(tmp_path):
    from actbus import consumer as consumers
    from consumers.null import NullConsumer

    addrs = [f"ipc://{tmp_path}/p{i}.sock" for i in range(2)]
    pubs = [_pub(a) for a in addrs]
    for p in pubs:
        threading.Thread(
            target=lambda p=p: (
                time.sleep(1.0),
                [p.publish(*_msg(i)) for i in range(50)],
                p.close(timeout=5),
            ),
            daemon=True,
        ).start()
    out = consumers.run(NullConsumer, ",".join(addrs), exit_on_end=True)
    assert out.failure is None and out.received == 100
    assert {a: r["received"] for a, r in out.publishers.items()} == dict.fromkeys(addrs, 50)
