"""The control endpoint against hostile peers (issue 33): real sockets, real processes.

Peers that never read their ``status`` replies, a flood of refused pushes, a version
meant to use up the version space, another local user racing the socket's bind, and
keyless TCP. No engine: the endpoint alone."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from actbus.bus.control import (
    SWAPS_KEPT,
    SWAPS_REPORTED,
    ControlClient,
    ControlConfig,
    ControlServer,
    PushRefused,
)
from actbus.bus.pushwire import MAX_VERSION_STEP, Slot
from actbus.errors import ConfigError
from tests.support.procs import wait_for

SLOTS = {"p": Slot(1, 8, "sigmoid")}
W = np.arange(8, dtype=np.float32)

# A control endpoint in a process of its own (its memory is what is measured): it
# fills its swap log, says "ready", then answers each stdin line with its RSS and status.
SERVER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from actbus.bus.control import ControlClient, ControlConfig, ControlServer, SWAPS_KEPT
    from actbus.bus.pushwire import Slot

    srv = ControlServer(ControlConfig(sys.argv[1]), {"p": Slot(1, 8, "sigmoid")}, {"p": 1})
    with ControlClient(sys.argv[1], timeout_s=30) as c:
        for i in range(SWAPS_KEPT):
            c.push("p", np.full(8, i % 7, np.float32), [0.0])
            srv.take()

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    print(json.dumps({"rss_mb": rss_mb()}), flush=True)
    for _ in sys.stdin:
        st = srv.status()
        print(json.dumps({"rss_mb": rss_mb(), "replies_dropped": st.get("replies_dropped"),
                          "swaps_total": st.get("swaps_total")}), flush=True)
    srv.close()
    """
)


def _ask(proc: subprocess.Popen) -> dict:
    import json

    proc.stdin.write("?\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_status_replies_to_peers_that_never_read_stay_bounded(tmp_path):
    """Issue 33, MEDIUM 4: with a full swap log a status reply was ~320 KiB, and replies
    to peers that never read them piled up in the engine (3 peers: +960 MB). Now a reply
    is a few KiB, at most ``SEND_HWM`` wait per peer, and the rest are counted."""
    address = f"ipc://{tmp_path}/c.sock"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    ctx = zmq.Context()
    peers = []
    try:
        import json

        before = json.loads(proc.stdout.readline())["rss_mb"]
        request = msgpack.packb({"op": "status"})
        for _ in range(3):
            peer = ctx.socket(zmq.DEALER)
            peer.linger = 0
            peer.rcvhwm = 1
            peer.setsockopt(zmq.RCVBUF, 4096)
            peer.connect(address)
            peers.append(peer)
        for _ in range(300):  # 300 requests each, and never a reply read
            for peer in peers:
                peer.send(request)
        # Wait until the endpoint has answered them all: dropped replies stop growing.
        seen: list[float] = []

        def settled() -> bool:
            seen.append(_ask(proc)["rss_mb"])
            time.sleep(0.5)
            return len(seen) >= 4 and max(seen[-4:]) - min(seen[-4:]) < 1

        wait_for(settled, timeout=120, what="the endpoint to answer every status request")
        after = _ask(proc)
        assert after["rss_mb"] - before < 48, (before, after)  # was +270 MB
        with ControlClient(address, timeout_s=30) as c:
            st = c.status()
        assert len(msgpack.packb(st)) < 8192  # was ~320 KiB
        assert st["swaps_total"] == SWAPS_KEPT and len(st["swaps"]) == SWAPS_REPORTED
        assert st["swap_ms"]["over"] == SWAPS_KEPT and st["swap_ms"]["max"] >= 0
        with ControlClient(address, timeout_s=30) as c:  # the whole log, a page a reply
            log = c.swaps()
            assert [s["version"] for s in log] == list(range(2, SWAPS_KEPT + 2))
            assert [s["version"] for s in c.swaps(SWAPS_KEPT - 3)] == [4095, 4096, 4097]
            with pytest.raises(PushRefused, match="start: expected a swap number"):
                c.swaps(-1)
        # 900 asked; what did not fit the kernel's buffers and SEND_HWM is counted
        assert after["replies_dropped"] > 450, after
    finally:
        for peer in peers:
            peer.close(linger=0)
        ctx.term()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_refused_pushes_are_logged_at_a_bounded_rate(tmp_path, caplog):
    """Issue 33, LOW: 39,001 warning lines in 5 s. Now a burst, then about one a
    second; the held-back lines are counted in the next one, every refusal in status."""
    srv = ControlServer(ControlConfig(f"ipc://{tmp_path}/c.sock"), SLOTS, {"p": 1})
    try:
        with (
            caplog.at_level(logging.WARNING, logger="actbus.control"),
            ControlClient(srv.cfg.address, timeout_s=10) as c,
        ):
            for _ in range(500):
                with pytest.raises(PushRefused):
                    c.push("nope", W, [0.0])
            assert c.status()["refused"] == 500
        lines = [r for r in caplog.records if r.name == "actbus.control"]
        assert 1 <= len(lines) <= 30, len(lines)
    finally:
        srv.close()


def test_a_huge_version_is_refused_and_cannot_lock_out_later_ones(tmp_path):
    """Issue 33, LOW: a push with version 2**62 was taken, and no explicit version could
    follow it. Now a version more than 2**32 above the current one is refused by name."""
    srv = ControlServer(ControlConfig(f"ipc://{tmp_path}/c.sock"), SLOTS, {"p": 1})
    try:
        with ControlClient(srv.cfg.address, timeout_s=10) as c:
            for v in (2**62, 2**63, 2**64 - 1, 1 + MAX_VERSION_STEP + 1):
                with pytest.raises(PushRefused, match="would use up the version space") as e:
                    c.push("p", W, [0.0], version=v)
                assert e.value.field == "version"
            assert c.push("p", W, [0.0], version=1 + MAX_VERSION_STEP)["version"] == 1 + 2**32
            assert c.push("p", W, [0.0], version=2**32 + 7)["version"] == 2**32 + 7
            assert c.push("p", W, [0.0])["version"] == 2**32 + 8
    finally:
        srv.close()


def test_keyless_tcp_control_is_refused_even_on_loopback():
    """Issue 33, MEDIUM 7: keyless control on tcp://127.0.0.1 took a push from another
    local user (``nobody``). ZeroMQ cannot tell who connected to a TCP port, so control
    on TCP needs CURVE keys; the error names both fixes."""
    for address in ("tcp://127.0.0.1:5999", "tcp://localhost:5999", "tcp://[::1]:5999"):
        with pytest.raises(ConfigError, match=r"control on TCP needs CURVE keys.*ipc path"):
            ControlConfig.from_raw(address, {})
    with pytest.raises(ConfigError, match="control on TCP needs CURVE keys"):
        ControlServer(ControlConfig("tcp://127.0.0.1:5999"), SLOTS, {"p": 1})
    assert ControlConfig.from_raw("ipc:///tmp/x.sock", {}).address == "ipc:///tmp/x.sock"


# Another user (nobody) connects to the socket's path as fast as it can; it prints how
# many connects got through. Runs on the system's python: nobody need not read the venv.
RACER = textwrap.dedent(
    """
    import os, socket, sys, time
    path, stop = sys.argv[1], sys.argv[2]
    got = 0
    end = time.monotonic() + 120
    while not os.path.exists(stop) and time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            got += 1
        except OSError:
            pass
        finally:
            s.close()
    print(got, flush=True)
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv, to connect as another user (nobody)",
)
def test_another_user_never_connects_to_the_ipc_socket_while_it_binds():
    """Issue 33, MEDIUM 7: the ipc socket was chmod-ed after bind, and another user's
    connects slipped into that window (14 of 30 starts). Now the socket is bound in a
    private directory and renamed into place already 0600: under a umask that would
    make it world-writable, in a directory anyone may use, ``nobody`` gets in never."""
    shared = Path(tempfile.mkdtemp(prefix="actbus-race-"))
    shared.chmod(0o1777)
    path, stop = shared / "c.sock", shared / "stop"
    racer = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
         "/usr/bin/python3", "-c", RACER, str(path), str(stop)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    old = os.umask(0)
    try:
        for _ in range(30):
            srv = ControlServer(ControlConfig(f"ipc://{path}"), SLOTS, {"p": 1})
            assert (path.stat().st_mode & 0o777) == 0o600
            time.sleep(0.02)
            srv.close()
        left = sorted(p.name for p in shared.iterdir())
    finally:
        os.umask(old)
        stop.touch()
        out, _ = racer.communicate(timeout=60)
        shutil.rmtree(shared, ignore_errors=True)
    assert out.strip() == "0", f"another user connected {out.strip()} times"
    assert left == []  # neither the socket nor a private directory is left behind
