"""Stops of ``actbus serve`` with the farewell's race forced, many at once, no vLLM:

python -m tests.support.stop_harness DIR MODE...

For each MODE, run ``i`` (under ``DIR/i/``) is what ``actbus serve`` runs, in real
processes: a supervisor (``actbus.serve.supervise``, its log in ``serve.log``) whose
server is ``standin_server.py``; an engine core connected to that server; and the
engine's worker, holding a real ``Publisher`` at ``ipc://DIR/i/bus.sock`` and
publishing a small message every 50 ms. When its engine core goes, the worker holds
the address ``HOLD_S`` longer, then dies without END (the socket file stays), as a
killed vLLM engine process outlives the server that killed it:

- ``sigint``, ``sigterm``: the test sends the supervisor that signal (the server tells
  its engine core to stop and exits at once);
- ``kill``: the test kills the engine core (SIGKILL); the server sees it die and exits 1;
- ``hung``: stopped with SIGINT, but the worker never lets go (it sits in the server's
  process group, as vLLM's engine processes do): the supervisor must kill it.

Prints ``ready I SUPERVISOR ENGINE_CORE WORKER`` once a run's publisher is bound, and
``exit I RC`` as its supervisor exits. Every process is forked from this one once its
imports are done, so twenty runs cost one interpreter start.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from actbus.bus import Publisher
from actbus.config import CaptureConfig
from actbus.logcap import show_own_logs
from actbus.serve import supervise
from tests.support.bus_procs import message

HOLD_S = 1.5
"""How long a worker holds its address after its engine core went (the old farewell
looked once, at once, and gave up)."""
RELEASE_S = 4.0
"""The supervisor's bound on waiting for the address before it kills what is left."""
STANDIN = Path(__file__).with_name("standin_server.py")
MODES = ("sigint", "sigterm", "kill", "hung")


def _supervisor(run: Path, address: str) -> None:
    fd = os.open(run / "serve.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    show_own_logs("%(asctime)s actbus serve: %(message)s")  # as actbus serve's main does
    cfg = CaptureConfig.from_dict({"layers": [0], "publish": address})
    cmd = [sys.executable, "-S", str(STANDIN), str(run / "ctl.sock")]
    rc = 99
    try:
        rc = supervise(cmd, cfg, [0], release_s=RELEASE_S)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _engine_core(i: int, mode: str, run: Path, address: str, supervisor: int) -> None:
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 60
    while True:
        try:
            ctl.connect(str(run / "ctl.sock"))
            break
        except OSError:
            if time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.02)
    server = int(ctl.makefile().readline())
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(w)
        ctl.close()
        _worker(i, mode, address, r, supervisor, os.getppid(), server)
    os.close(r)
    ctl.recv(64)  # "stop", or the server is gone
    os._exit(0)  # an engine core killed at once; its worker sees the pipe close


def _worker(
    i: int, mode: str, address: str, core: int, supervisor: int, engine: int, server: int
) -> None:
    if mode == "hung":  # in the server's process group, deaf to SIGINT and SIGTERM
        os.setpgid(0, server)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    pub = Publisher(address, info={"model": "stand-in", "layers": [0], "hooks": ["post_block"]})
    print(f"ready {i} {supervisor} {engine} {os.getpid()}", flush=True)
    step = 0
    while True:
        pub.publish(*message(step, rows=2, hidden=8))
        step += 1
        if select.select([core], [], [], 0.05)[0] and not os.read(core, 64):
            break  # the engine core is gone
    time.sleep(3600 if mode == "hung" else HOLD_S)
    os._exit(0)  # no close, no END: what a killed engine leaves


def main(root: Path, modes: list[str]) -> None:
    supervisors: dict[int, int] = {}
    for i, mode in enumerate(modes):
        assert mode in MODES, mode
        run = root / str(i)
        run.mkdir(parents=True)
        address = f"ipc://{run}/bus.sock"
        sys.stdout.flush()
        sup = os.fork()
        if sup == 0:
            _supervisor(run, address)
        supervisors[sup] = i
        if os.fork() == 0:
            _engine_core(i, mode, run, address, sup)
    while supervisors:
        pid, status = os.wait()
        if pid in supervisors:
            print(f"exit {supervisors.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
