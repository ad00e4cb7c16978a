"""A stand-in for vLLM's API server under ``actbus serve``, stdlib only (starts in
milliseconds): ``python -S standin_server.py CTL``.

It listens on the unix socket CTL for its engine (``stop_harness``), which connects
and is sent this process's pid. Like vLLM's server it then serves until either:

- SIGINT or SIGTERM: it tells the engine to stop and exits 0 at once, without
  waiting for the engine to be gone (vLLM's shutdown kills its engine and exits; the
  engine's process can outlive it by a moment);
- its engine dies (the connection closes): it exits 1, as vLLM's watchdog ends a
  server whose engine died.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys

stop_r, stop_w = os.pipe()


def _stop(signum: int, _frame: object) -> None:
    os.write(stop_w, b"x")


def main(ctl: str) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(ctl)
        srv.listen(1)
        ready, _, _ = select.select([srv, stop_r], [], [], 120)
        if srv not in ready:
            print("standin: no engine connected", file=sys.stderr, flush=True)
            return 3
        engine, _ = srv.accept()
    engine.sendall(f"{os.getpid()}\n".encode())
    print("standin: serving", file=sys.stderr, flush=True)
    while True:
        ready, _, _ = select.select([engine, stop_r], [], [])
        if stop_r in ready:
            engine.sendall(b"stop\n")
            print("standin: stopped; engine told to stop", file=sys.stderr, flush=True)
            return 0
        if not engine.recv(64):
            print("standin: the engine died", file=sys.stderr, flush=True)
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
