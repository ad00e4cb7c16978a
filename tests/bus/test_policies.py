"""Every policy with a deliberately slow subscriber process beside a fast lossless one.

For each subscriber, every message routed to it is sent, dropped (by a counted
reason) or still queued (in memory or spilled): ``routed == sent + dropped +
queue_depth`` in every consistent snapshot, and the subscriber's own gap count
equals the publisher's drop count for it. Spill replays in order, respects its
cap, and deletes its segments.
"""

from __future__ import annotations

import threading
import time

import pytest

from actbus.bus import Batch, Publisher, Subscriber, Subscription, statsview
from actbus.bus.protocol import parse_policy
from actbus.bus.spill import SpillLog
from tests.support.bus_procs import Proc, message
from tests.support.procs import wait_for

N = 300
CAP_MB = 0.25
CAP = int(CAP_MB * (1 << 20))
SLOW = {  # name: (policy, seconds per batch)
    "block": ("block", 0.005),
    "drop_newest": ("drop_newest", 0.03),
    "drop_oldest": ("drop_oldest", 0.03),
    "sample": ("sample:3", 0.03),
    "spill_newest": (f"spill:{CAP_MB}:drop_newest", 0.03),
    "spill_oldest": (f"spill:{CAP_MB}:drop_oldest", 0.03),
    "spill_block": (f"spill:{CAP_MB}:block", 0.01),
}


def _check_invariant(snap: dict) -> None:
    for name, st in snap["subscribers"].items():
        if name == statsview.CLIENT_NAME:
            continue
        dropped = sum(st["dropped"].values())
        assert st["routed"] == st["sent"] + dropped + st["queue_depth"], (name, st)
        assert st["queue_depth"] == st["pending"] + st["spill_depth"], (name, st)


def _spill_files(root) -> list:
    return sorted(root.rglob("*.spill"))


def test_every_policy_beside_a_fast_lossless_subscriber(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    spill_root = tmp_path / "spill"
    spill_root.mkdir()
    pub = Publisher(address, info={"model": "test"}, heartbeat_s=0.1, spill_dir=spill_root)
    fast = Proc("subscribers", address, "fast:block:0:64")
    slow = Proc("subscribers", address, *(f"{n}:{p}:{d}:2" for n, (p, d) in SLOW.items()))
    stats_sub = Subscriber(address, statsview.stats_subscription(), keepalive=False)
    try:
        fast.ready(1)
        slow.ready(len(SLOW))
        stats_sub.wait_welcome(10)
        feeder = threading.Thread(
            target=lambda: [pub.publish(*message(i)) for i in range(N)], daemon=True
        )
        feeder.start()
        # Consistent snapshots (made on the publisher thread) while spills hold data.
        seen_spilled = 0
        while feeder.is_alive() or pub.stats()["published"] < N:
            snap = statsview.request(stats_sub, 10)
            _check_invariant(snap)
            seen_spilled += any(
                st["spill_depth"] > 0 for n, st in snap["subscribers"].items() if "spill" in n
            )
            time.sleep(0.05)
        assert seen_spilled, "no snapshot caught a spill holding data"

        def drained():
            snap = statsview.request(stats_sub, 10)
            subs = [s for n, s in snap["subscribers"].items() if n != statsview.CLIENT_NAME]
            return snap if all(s["queue_depth"] == 0 and s["inflight"] == 0 for s in subs) else None

        final = wait_for(drained, 60, "every subscriber to drain")
        _check_invariant(final)
        assert _spill_files(spill_root) == [], "replayed segments were not deleted"
        time.sleep(0.5)  # heartbeats tell the subscribers about trailing drops
        pub.close(timeout=5)
        got = {**fast.results(1), **slow.results(len(SLOW))}
    finally:
        stats_sub.close()
        pub.close(timeout=1)
        fast.kill()
        slow.kill()

    assert got["fast"]["steps"] == list(range(N)) and got["fast"]["seqs"] == list(range(N))
    assert got["fast"]["missed"] == 0
    subs = final["subscribers"]
    for name in SLOW:
        r, st = got[name], subs[name]
        dropped = sum(st["dropped"].values())
        assert r["bad_values"] == 0 and r["rejected"] == 0, name
        assert r["seqs"] == sorted(set(r["seqs"])), f"{name}: seqs out of order"
        assert r["steps"] == sorted(set(r["steps"])), f"{name}: steps out of order"
        assert r["received"] == st["sent"], (name, r["received"], st)
        assert r["missed"] == dropped, (name, r["missed"], st["dropped"])
        assert st["routed"] + st["sampled_out"] == N, (name, st)
        assert r["publisher_view"]["sent"] == st["sent"], name  # heartbeats carry it
    for name in ("block", "spill_block"):  # lossless: everything, in order
        assert got[name]["steps"] == list(range(N)) and subs[name]["dropped"] == {}, name
    assert subs["drop_newest"]["dropped"]["queue_full"] > 0
    assert subs["drop_oldest"]["dropped"]["evicted"] > 0
    assert subs["sample"]["sampled_out"] == N - len(range(0, N, 3))
    assert all(s % 3 == 0 for s in got["sample"]["steps"])
    for name in ("spill_newest", "spill_oldest", "spill_block"):
        st = subs[name]
        assert st["spilled"] > 0 and st["replayed"] > 0, (name, st)
        assert 0 < st["spill_peak_bytes"] <= CAP, (name, st["spill_peak_bytes"])
    for name in ("spill_newest", "spill_oldest"):  # the cap was reached: fallback drops
        assert subs[name]["dropped"]["spill_full"] > 0, subs[name]
    # drop_newest keeps the oldest spilled, drop_oldest the newest: the last step
    # reaches only the latter.
    assert got["spill_oldest"]["steps"][-1] == N - 1
    assert subs["spill_newest"]["replayed"] == subs["spill_newest"]["spilled"]
    assert list(spill_root.iterdir()) == [], "the publisher left its spill directory behind"


@pytest.mark.usefixtures("bus_path")
def test_spill_is_deleted_and_counted_when_the_subscriber_leaves(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1, spill_dir=tmp_path)
    try:
        sub = Subscriber(address, Subscription(policy="spill", spill_mb=1, window=1, name="s"))
        sub.wait_welcome(10)
        for i in range(40):  # never read: 1 in flight, 8 pending, the rest spilled
            pub.publish(*message(i))
        wait_for(lambda: pub.stats()["published"] == 40, 10, "all routed")
        st = pub.stats()["subscribers"]["s"]
        assert (st["sent"], st["pending"], st["spill_depth"]) == (1, 8, 31), st
        assert len(list(tmp_path.rglob("*.spill"))) == 1
        sub.close()
        wait_for(lambda: not pub.stats()["subscribers"], 10, "the subscriber to leave")
        gone = pub.stats()["departed"][-1]
        assert gone["reason"] == "left" and gone["dropped"] == {"left": 39}, gone
        assert gone["routed"] == gone["sent"] + 39
        assert list(tmp_path.rglob("*.spill")) == []
    finally:
        pub.close(timeout=1)


def test_spill_replays_across_segments_in_order(tmp_path):
    """Real files: several segments, each deleted once its last record is read."""
    log = SpillLog(tmp_path / "s", segment_bytes=10_000)
    for seq in range(20):
        hdr, t = message(seq, rows=1, hidden=1024)  # 4 KiB payload each
        log.append(seq, seq, hdr.encode(), t.numpy().tobytes())
    assert len(list((tmp_path / "s").iterdir())) == 7  # 3 records per 10 kB segment
    seen = []
    while log:
        rec = log.head()
        _, payload = log.read_head()
        log.discard()
        seen.append(rec.seq)
        assert len(payload) == 4096 and bytes(payload[:4]) == bytes(
            message(rec.seq, 1, 1024)[1].numpy().tobytes()[:4]
        )
        left = len({seq // 3 for seq in range(len(seen), 20)})  # segments with unread records
        assert len(list((tmp_path / "s").iterdir())) == left, len(seen)
    assert seen == list(range(20)) and log.nbytes == 0
    log.close()
    assert not (tmp_path / "s").exists()


@pytest.mark.usefixtures("bus_path")
def test_spill_block_fallback_holds_the_stream_at_the_cap(tmp_path):
    """Cap reached with fallback block: nothing dropped, the publisher waits instead."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(
        address, info={"model": "t"}, heartbeat_s=0.1, spill_dir=tmp_path, queue_bytes=1 << 18
    )
    try:
        sub = Subscriber(
            address, Subscription(**parse_policy("spill:0.125:block"), window=1, name="sb")
        )
        sub.wait_welcome(10)
        done = threading.Event()

        def feed():
            for i in range(60):
                pub.publish(*message(i))
            done.set()

        threading.Thread(target=feed, daemon=True).start()
        assert not done.wait(1.5), "publish did not wait at the spill cap"
        st = pub.stats()["subscribers"]["sb"]
        assert st["dropped"] == {} and 0 < st["spill_bytes"] <= (1 << 17), st
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 60 and time.monotonic() < deadline:
            out = sub.recv(timeout=0.2)
            if isinstance(out, Batch):
                got.append(out.step)
        assert done.wait(10)
        assert got == list(range(60)) and sub.stats.missed == 0
        assert pub.stats()["subscribers"]["sb"]["spill_peak_bytes"] <= 1 << 17
        sub.close()
    finally:
        pub.close(timeout=1)


@pytest.mark.parametrize(
    "wire, field",
    [
        ({"policy": "spill", "spill_mb": -1}, "spill_mb"),
        ({"policy": "spill", "spill_fallback": "sample"}, "spill_fallback"),
        ({"tags": {"split": {"nested": 1}}}, "tags"),
        ({"tags": ["split"]}, "tags"),
        ({"group": 7}, "group"),
        ({"policy": "sample", "sample_per_s": -1}, "sample_per_s"),
        ({"policy": "sample", "sample_per_s": "fast"}, "sample_per_s"),
        ({"policy": "sample", "sample_per_s": True}, "sample_per_s"),
        ({"policy": "sample", "sample_per_s": float("nan")}, "sample_per_s"),
    ],
)
def test_bad_subscription_fields_are_refused_by_name(wire, field):
    from actbus.bus.protocol import Subscription as S
    from actbus.wire import SCHEMA_VERSION, WireError

    with pytest.raises(WireError, match=field):
        S.from_wire({"schema": SCHEMA_VERSION, **wire})
