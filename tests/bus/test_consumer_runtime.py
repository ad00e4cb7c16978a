"""Consumers that raise: reported, then stopped or restarted, and nobody else notices.

The consumer runs as `actbus run null --fail-at N` in its own process (the null
consumer's fault drill), beside a real publisher and a healthy in-process subscriber.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from actbus import consumer as consumers
from actbus.bus import Batch, Publisher, Subscriber, Subscription
from actbus.cli import consumer_command, main
from actbus.consumer import Consumer, RestartPolicy
from actbus.wire import Header, RowIndex
from tests.support.procs import ROOT, recv_batches, wait_for


@pytest.fixture
def publisher(address):
    pub = Publisher(address, info={"model": "test"}, queue_bytes=1 << 20, heartbeat_s=0.1)
    yield pub
    pub.close(timeout=2)


@pytest.fixture
def healthy(address):
    """A lossless subscriber beside the faulty consumer: it must see every step in order."""
    with Subscriber(address, Subscription(window=8, name="healthy")) as sub:
        sub.wait_welcome(10)
        yield sub


def _msg(step: int, rows: int = 4, hidden: int = 32):
    ri = RowIndex(["r"], np.array([0, rows]), np.arange(rows), np.arange(rows))
    hdr = Header(step, 0, "post_block", "float32", (rows, hidden), "test", ri)
    return hdr, torch.full((rows, hidden), float(step))


def _in_order(got: list[Batch], n: int) -> None:
    assert [b.step for b in got] == list(range(n))
    assert [b.seq for b in got] == list(range(n))


class _Run:
    """`actbus run null ...` as its own process, its output in files."""

    def __init__(self, tmp_path: Path, address: str, *flags: str) -> None:
        self.out, self.err = tmp_path / "null.out", tmp_path / "null.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                consumer_command("null", address, *flags),
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def stderr(self) -> str:
        return self.err.read_text()

    def totals(self) -> list[dict[str, Any]]:
        """One JSON line per consumer instance, printed when it closes."""
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"actbus run did not exit:\n{self.stderr()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _departures(pub: Publisher, name: str) -> list[str]:
    """Why each subscriber called ``name`` went: a consumer that failed leaves like any
    other (its goodbye, or its closed connection, whichever the publisher reads first)."""
    return [d["reason"] for d in pub.stats()["departed"] if d["name"] == name]


def _joined(pub: Publisher, name: str, left: int = 0) -> bool:
    return name in pub.stats()["subscribers"] and len(_departures(pub, name)) >= left


def test_restart_keeps_receiving_and_nobody_else_notices(publisher, address, healthy, tmp_path):
    run = _Run(
        tmp_path,
        address,
        *("--fail-at", "5", "--on-error", "restart", "--max-restarts", "3", "--exit-on-end"),
    )
    try:
        wait_for(lambda: _joined(publisher, "null"), 30, "the consumer to subscribe")
        for i in range(10):  # the consumer raises on its 5th batch (step 4)
            publisher.publish(*_msg(i))
        got = recv_batches(healthy, 10)
        wait_for(lambda: "restart 1 of 3" in run.stderr(), 20, "the restart to be reported")
        wait_for(lambda: _joined(publisher, "null", left=1), 20, "a fresh subscription")
        for i in range(10, 13):
            publisher.publish(*_msg(i))
        got += recv_batches(healthy, 3)
        publisher.close(timeout=5)  # END: --exit-on-end makes the consumer exit
        assert run.wait(20) == 0, run.stderr()
    finally:
        run.kill()
    _in_order(got, 13)
    assert healthy.stats.missed == 0
    err = run.stderr()
    assert "'null' failed in on_batch: RuntimeError: fault drill: --fail-at 5, step 4" in err
    assert "Traceback" in err and "errors=1 restarts=1" in err
    # First instance: 4 batches, then it raised; the fresh one got everything sent after it joined.
    assert [t["messages"] for t in run.totals()] == [4, 3]
    assert publisher.stats()["published"] == 13
    assert set(_departures(publisher, "null")) <= {"left", "disconnected"}


def test_a_consumer_ends_with_its_stream_unless_told_to_keep_waiting(address, tmp_path):
    """Issue 50: a consumer started as the README starts it (no flag) kept waiting, and
    saying so, forever after the server stopped. It ends, status 0, with the stream;
    ``--keep-waiting`` keeps it subscribed for the next publisher at the address."""
    ended = _Run(tmp_path, address)
    (tmp_path / "keep").mkdir()
    kept = _Run(tmp_path / "keep", address, "--keep-waiting")
    try:
        pub = Publisher(address, info={"model": "test"}, heartbeat_s=0.1)
        try:
            wait_for(lambda: len(pub.stats()["subscribers"]) >= 2, 30, "both to subscribe")
            pub.publish(*_msg(0))
        finally:
            pub.close(timeout=5)  # a clean stop: END
        assert ended.wait(30) == 0, ended.stderr()
        assert "the publisher ended the stream: stopping" in ended.stderr()
        assert [t["messages"] for t in ended.totals()] == [1]
        # the other waits for the next publisher and takes its stream up
        pub = Publisher(address, info={"model": "test"}, heartbeat_s=0.1)
        try:
            wait_for(lambda: "null" in pub.stats()["subscribers"], 30, "the resubscription")
            assert kept.proc.poll() is None
        finally:
            pub.close(timeout=5)
    finally:
        ended.kill()
        kept.kill()


def test_stop_exits_nonzero_naming_the_error_and_the_bus_goes_on(
    publisher, address, healthy, tmp_path
):
    run = _Run(tmp_path, address, "--fail-at", "3")  # --on-error stop is the default
    try:
        wait_for(lambda: _joined(publisher, "null"), 30, "the consumer to subscribe")
        for i in range(10):
            publisher.publish(*_msg(i))
        got = recv_batches(healthy, 10)
        assert run.wait(20) == 1
    finally:
        run.kill()
    err = run.stderr()
    assert "actbus run null: consumer 'null' failed in on_batch: RuntimeError: fault drill" in err
    assert "--on-error restart restarts it" in err and "Traceback" in err
    wait_for(lambda: "null" not in publisher.stats()["subscribers"], 10, "the consumer to leave")
    for i in range(10, 20):
        publisher.publish(*_msg(i))
    got += recv_batches(healthy, 10)
    _in_order(got, 20)
    assert len(_departures(publisher, "null")) == 1
    assert set(_departures(publisher, "null")) <= {"left", "disconnected"}


def test_restarts_are_bounded(publisher, address, healthy, tmp_path):
    stop = threading.Event()
    published = [0]

    def feed() -> None:
        while not stop.wait(0.05):
            publisher.publish(*_msg(published[0]))
            published[0] += 1

    run = _Run(tmp_path, address, "--fail-at", "1", "--on-error", "restart", "--max-restarts", "1")
    feeder = threading.Thread(target=feed, daemon=True)
    got: list[Batch] = []
    try:
        wait_for(lambda: _joined(publisher, "null"), 30, "the consumer to subscribe")
        feeder.start()
        deadline = time.monotonic() + 30
        while run.proc.poll() is None and time.monotonic() < deadline:
            got += recv_batches(healthy, 1, timeout=0.2)
        assert run.wait(1) == 1
    finally:
        stop.set()
        feeder.join(timeout=10)
        run.kill()
    wait_for(lambda: publisher.stats()["published"] == published[0], 10, "all published")
    got += recv_batches(healthy, published[0] - len(got))
    _in_order(got, published[0])
    err = run.stderr()
    assert "restart 1 of 1" in err and "errors=2 restarts=1" in err
    assert "gave up after 1 restarts (--max-restarts)" in err


# ----------------------------------------------------------- the runner in-process


class _Faulty(Consumer):
    name = "faulty"
    built = 0

    def __init__(self, where: str) -> None:
        self.where = where
        type(self).built += 1

    @classmethod
    def from_args(cls, args: Any) -> _Faulty:
        return cls(args)

    def on_welcome(self, info: dict[str, Any]) -> None:
        if self.where == "on_welcome":
            raise ValueError("no thanks")

    def on_batch(self, batch: Batch) -> None:
        pass

    def close(self) -> None:
        if self.where == "close":
            raise OSError("disk gone")


def test_any_callback_error_is_counted_and_restarts_make_fresh_subscriptions(publisher, address):
    _Faulty.built = 0
    policy = RestartPolicy(on_error="restart", max_restarts=2, backoff_s=0.05)
    out = consumers.run(lambda: _Faulty("on_welcome"), address, restart=policy)
    assert out.restarts == 2 and out.errors == 3 and _Faulty.built == 3
    assert out.failure is not None and out.failure.callback == "on_welcome"
    assert isinstance(out.failure.error, ValueError)
    wait_for(lambda: len(_departures(publisher, "faulty")) == 3, 10, "three departures")


def test_close_and_construction_errors_are_failures_too(publisher, address):
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    out = consumers.run(lambda: _Faulty("close"), address, stop=stop)
    assert out.errors == 1 and out.failure is not None and out.failure.callback == "close"

    def broken() -> Consumer:
        raise FileNotFoundError("no such checkpoint")

    out = consumers.run(broken, address, restart=RestartPolicy("restart", 1, 0.0))
    assert out.errors == 2 and out.restarts == 1 and out.failure.callback == "construction"


def test_run_flags_are_checked(capsys):
    for argv, needle in [
        (["--max-restarts", "2"], "--max-restarts applies only with --on-error restart"),
        (["--on-error", "restart", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        (["--on-error", "retry"], "invalid choice: 'retry'"),
        (["--server-key", "/nonexistent"], "--client-secret-key: required with --server-key"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["run", "null", "--connect", "ipc:///tmp/x.sock", *argv])
        assert e.value.code == 2
        assert needle in capsys.readouterr().err
