"""Bus test processes: real subscribers and publishers in their own processes.

python -m tests.bus_procs subscribers ADDR NAME[@GROUP]:POLICY:DELAY_S:WINDOW ...
    One thread per subscriber, each sleeping DELAY_S per batch (a slow consumer);
    ``@GROUP`` makes it a member of a load-balancing group; WINDOW may be
    MESSAGES/MIB, credit in messages and MiB.
    Prints "ready NAME" once welcomed, and at the publisher's END one JSON line
    per subscriber: what it received (seqs, steps) and its own counters.
    (POLICY may itself contain colons: the spec is split from both ends.)
python -m tests.bus_procs publisher ADDR HZ
    Publishes a step every 1/HZ s until killed; prints "ready ID" once bound.
python -m tests.bus_procs holder ADDR N
    Reads N batches and keeps them (views of shared memory) until killed.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from actbus.bus import Batch, Event, Publisher, Subscriber, Subscription
from actbus.bus.protocol import parse_policy
from actbus.wire import Header, RowIndex

_print_lock = threading.Lock()
ROOT = Path(__file__).resolve().parents[2]


class Proc:
    """A test process whose stdout lines are read in the background, with deadlines."""

    def __init__(self, *args: str, module: str = "tests.support.bus_procs") -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))

    def line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from {self.popen.args} in {timeout}s") from None

    def ready(self, n: int, timeout: float = 60.0) -> list[str]:
        """Wait for ``n`` "ready ..." lines; returns what followed "ready"."""
        deadline = time.monotonic() + timeout
        got = []
        while len(got) < n:
            line = self.line(max(0.01, deadline - time.monotonic()))
            if line.startswith("ready "):
                got.append(line[6:])
        return got

    def results(self, n: int, timeout: float = 30.0) -> dict[str, dict]:
        """The ``n`` JSON result lines, by subscriber name."""
        deadline = time.monotonic() + timeout
        out: dict[str, dict] = {}
        while len(out) < n:
            line = self.line(max(0.01, deadline - time.monotonic()))
            if line.startswith("{"):
                r = json.loads(line)
                out[r["name"]] = r
        return out

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)


def say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def message(step: int, rows: int = 4, hidden: int = 1024) -> tuple[Header, torch.Tensor]:
    """A 16 KiB message whose every value is its step number."""
    ri = RowIndex(["r"], np.array([0, rows]), np.arange(rows), np.arange(rows))
    hdr = Header(step, 0, "post_block", "float32", (rows, hidden), "test", ri)
    return hdr, torch.full((rows, hidden), float(step))


def _subscriber(address: str, spec: str) -> None:
    name, rest = spec.split(":", 1)
    name, _, group = name.partition("@")
    policy, delay, window = rest.rsplit(":", 2)
    window, _, mib = window.partition("/")
    credit = {"window": int(window)}
    if mib:
        credit["window_bytes"] = int(float(mib) * (1 << 20))
    sub = Subscriber(
        address,
        Subscription(**parse_policy(policy), **credit, name=name, group=group),
        silence_s=30,
    )
    seqs: list[int] = []
    steps: list[int] = []
    bad_values = 0
    ended = False
    try:
        sub.wait_welcome(60)
        say(f"ready {name}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            out = sub.recv(timeout=1.0)
            if isinstance(out, Batch):
                seqs.append(out.seq)
                steps.append(out.step)
                bad_values += int(float(out.tensor[0, 0]) != out.step)
                time.sleep(float(delay))
            elif isinstance(out, Event) and out.kind == "end":
                ended = True
                break
    finally:
        sub.close()
    s = sub.stats
    say(
        json.dumps(
            {
                "name": name,
                "seqs": seqs,
                "steps": steps,
                "bad_values": bad_values,
                "ended": ended,
                "received": s.received,
                "missed": s.missed,
                "rejected": s.rejected,
                "publisher_view": s.publisher_view,
            }
        )
    )


def subscribers(address: str, specs: list[str]) -> None:
    threads = [threading.Thread(target=_subscriber, args=(address, s)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def publisher(address: str, hz: float) -> None:
    pub = Publisher(address, info={"model": "proc"}, heartbeat_s=0.1)
    say(f"ready {pub.id}")
    step = 0
    while True:
        pub.publish(*message(step))
        step += 1
        time.sleep(1 / hz)


def holder(address: str, n: int) -> None:
    """Read ``n`` batches from shared memory and keep them (views of the publisher's
    region) until killed; prints "ready" once welcomed, then "held N PATH"."""
    sub = Subscriber(address, Subscription(window=64, name="holder"), silence_s=30)
    sub.wait_welcome(60)
    say("ready holder")
    kept = []
    while len(kept) < n:
        out = sub.recv(timeout=1.0)
        if isinstance(out, Batch):
            kept.append(out)
    say(f"held {len(kept)} {sub.stats.path}")
    time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1] == "subscribers":
        subscribers(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "holder":
        holder(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "publisher":
        publisher(sys.argv[2], float(sys.argv[3]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}")
