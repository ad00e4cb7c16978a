"""What a publisher killed with kill -9 leaves (its ipc socket file, its spill
directory) is cleaned at the next start, never what a live publisher holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from actbus.bus import Publisher, Subscriber, Subscription
from actbus.wire import HELLO, SCHEMA_VERSION, pack_map
from tests.support.bus_procs import Proc, message
from tests.support.procs import wait_for


def _spilling(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A peer that subscribes with ``spill`` and never acknowledges: past one message
    of credit and the memory queue, what is published for it goes to disk."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    hello = {"schema": SCHEMA_VERSION, "policy": "spill", "spill_mb": 1, "window": 1}
    s.send_multipart([HELLO, pack_map({**hello, "name": "spiller"})])
    return s


def _spills(tmp: Path) -> set[Path]:
    """The spill directories under ``tmp`` that hold a spilled segment."""
    return {p.parents[1] for p in tmp.glob("actbus-spill-*/*/seg-*.spill")}


def test_a_killed_publishers_files_are_cleaned_at_the_next_start_a_live_ones_never(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's spill goes here
    dead_addr, live_addr = f"ipc://{tmp_path}/bus.sock", f"ipc://{tmp_path}/live.sock"
    ctx = zmq.Context()
    child = Proc("publisher", dead_addr, "200")
    live = Publisher(live_addr, info={"model": "live"}, spill_dir=tmp_path)
    again = None
    try:
        child.ready(1)
        peers = [_spilling(ctx, dead_addr)]  # kept: a socket collected is closed
        wait_for(lambda: len(_spills(tmp_path)) == 1, 30, "the child spilling")
        (dead_spill,) = _spills(tmp_path)
        peers.append(_spilling(ctx, live_addr))
        wait_for(lambda: "spiller" in live.stats()["subscribers"], 10, "the spiller subscribed")
        for step in range(20):
            live.publish(*message(step))
        wait_for(lambda: len(_spills(tmp_path)) == 2, 30, "the live one spilling")
        child.kill()  # kill -9: nothing of its own cleanup runs
        assert (tmp_path / "bus.sock").exists() and dead_spill.exists()

        again = Publisher(dead_addr, info={"model": "again"}, spill_dir=tmp_path)
        assert not dead_spill.exists() and len(_spills(tmp_path)) == 1  # the live one's
        assert again.stats()["stale_spills_removed"] == 1
        with pytest.raises(OSError, match="live process"):
            Publisher(live_addr, info={"model": "thief"}, spill_dir=tmp_path)
        for address, pub in ((live_addr, live), (dead_addr, again)):
            with Subscriber(address, Subscription(layers=(), name="probe")) as sub:
                assert sub.wait_welcome(10)["publisher_id"] == pub.id
        assert os.path.exists(f"{tmp_path}/live.sock")
    finally:
        child.kill()
        live.close(timeout=1)
        if again is not None:
            again.close(timeout=1)
        ctx.destroy(linger=0)
