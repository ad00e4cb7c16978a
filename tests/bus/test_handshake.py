"""What a subscriber learns from the handshake, as a user meets it: one subscription
however many HELLOs waited for the publisher, a named refusal when the publisher does
not tap what was asked for, and a line every few seconds while no publisher answers.
Real publishers, real ``actbus run`` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from actbus.bus import Event, Publisher, Subscriber, Subscription
from tests.support.procs import ROOT, wait_for

INFO = {"model": "m", "hidden_size": 64, "layers": [1, 3], "hooks": ["post_block"]}


def _actbus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "actbus.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_hellos_queued_before_the_publisher_make_one_welcome(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    sub = Subscriber(address, Subscription(name="early"))
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:  # HELLO again every second, queued
            assert sub.recv(timeout=0.25) is None
        pub = Publisher(address, info=INFO, heartbeat_s=0.1)
        try:
            welcomes = 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                out = sub.recv(timeout=0.25)
                welcomes += isinstance(out, Event) and out.kind == "welcome"
            assert welcomes == 1 and sub.stats.welcomes == 1
            assert pub.stats()["resubscribed"] >= 1, "no HELLO was queued: the test tests nothing"
        finally:
            pub.close(timeout=1)
    finally:
        sub.close()


def test_a_layer_or_hook_the_publisher_does_not_tap_is_refused_at_once(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info=INFO, heartbeat_s=0.1)
    try:
        t0 = time.monotonic()
        r = _actbus("run", "fs-sink", "--connect", address, "--out", str(tmp_path / "run"),
                    "--layers", "7", timeout=60)  # fmt: skip
        assert r.returncode == 1, r.stderr[-2000:]
        assert "taps layers [1, 3] and hooks ['post_block'], not layer 7" in r.stderr
        assert "actbus run fs-sink: the publisher at" in r.stderr and "usage:" not in r.stderr
        assert time.monotonic() - t0 < 30
        r = _actbus("run", "sae", "--connect", address, "--layer", "1,7", "--no-progress",
                    "--out", str(tmp_path / "sae"))  # fmt: skip
        # issue 50: the same refusal, the same status and one line in every command (it
        # was status 2 with argparse's usage, as if a flag were malformed)
        assert r.returncode == 1, r.stderr[-2000:]
        assert "actbus run sae: the publisher at" in r.stderr, r.stderr[-2000:]
        assert "not layer 7 asked for" in r.stderr and "usage:" not in r.stderr
        assert "Traceback" not in r.stderr
        (line,) = [x for x in r.stderr.splitlines() if "not layer 7" in x]
        assert line.startswith("actbus run sae: ")
        r = _actbus("run", "sae", "--connect", address, "--layer", "3", "--hook", "mlp_out",
                    "--d-in", "64", "--no-progress", "--out", str(tmp_path / "sae"))  # fmt: skip
        assert r.returncode == 1, r.stderr[-2000:]
        assert "actbus run sae: the publisher at" in r.stderr and "not hook mlp_out" in r.stderr
        assert "Traceback" not in r.stderr
    finally:
        pub.close(timeout=1)


def test_a_consumer_with_no_publisher_says_what_it_waits_for(tmp_path):
    address = f"ipc://{tmp_path}/nobody.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "run", "fs-sink", "--connect", address,
         "--out", str(tmp_path / "run"), "--layers", "3"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: sum("no publisher has answered" in line for line in lines) >= 2,
            60,
            "two waiting lines",
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=10)
    waiting = [line for line in lines if "no publisher has answered" in line]
    assert (
        f"at {address} for 5s; still waiting, to subscribe to layers [3], all hooks" in waiting[0]
    )
    assert "policy block, as fs-sink" in waiting[0] and "for 10s" in waiting[1]


def test_a_missing_ipc_socket_file_is_named_within_seconds(tmp_path, caplog, monkeypatch):
    """Issue 50: a subscriber given an ipc:// path no publisher had bound waited in
    silence; it says, once and then in each waiting line, that the file does not exist."""
    import actbus.bus.subscriber as subscriber

    monkeypatch.setattr(subscriber, "WAITING_LOG_S", 1.0)  # the waiting line, sooner
    path = tmp_path / "typo.sock"
    sub = Subscriber(f"ipc://{path}", Subscription(name="early"))
    caplog.set_level("WARNING", logger="actbus.subscriber")

    def said(words: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if words in r.getMessage()]

    try:
        deadline = time.monotonic() + 20.0  # bounded; it takes about 2 s
        while time.monotonic() < deadline and len(said("no publisher has answered")) < 2:
            assert sub.recv(timeout=0.1) is None
        first = said("does not exist: no publisher is bound")
        assert len(first) == 1 and str(path) in first[0], caplog.text[-2000:]
        waiting = said("no publisher has answered")
        assert len(waiting) >= 2, caplog.text[-2000:]
        assert all(f"(the socket file {path} does not exist)" in w for w in waiting)
        # once the file is there (a publisher bound it), the waiting lines stop naming it
        pub = Publisher(f"ipc://{path}", info=INFO, heartbeat_s=0.1)
        try:
            deadline = time.monotonic() + 20.0
            got = None
            while time.monotonic() < deadline and not isinstance(got, Event):
                got = sub.recv(timeout=0.1)
            assert isinstance(got, Event) and got.kind == "welcome"
        finally:
            pub.close(timeout=1)
        assert len(said("does not exist: no publisher is bound")) == 1
    finally:
        sub.close()
