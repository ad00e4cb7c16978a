"""A publisher in its own process, so a test can measure its memory and its log.

python -m tests.support.bounded_publisher ADDR SECONDS MAX_WINDOW_MB MAX_SUBSCRIBERS

Logs to stderr at INFO, as the engine would. Waits for a subscriber named
``good``, prints "ready", then publishes 64 KiB messages (steps 0, 1, ...) as
fast as its queue allows until a line arrives on stdin (or SECONDS pass). Once
the session messages still waiting are handled (``rejected`` stops growing), it
prints one JSON line: how many it published, whether its thread was still alive,
and its counters. Then closes (END), so the ``good`` subscriber knows the stream
is over.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

from actbus.bus import Publisher
from tests.support.bus_procs import message

ROWS, HIDDEN = 16, 1024  # 64 KiB of float32 a message


def main(address: str, seconds: float, max_window_mb: float, max_subscribers: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    pub = Publisher(
        address,
        info={"model": "bounded"},
        heartbeat_s=0.1,
        subscriber_timeout_s=3.0,
        queue_bytes=8 << 20,
        max_window_mb=max_window_mb,
        max_subscribers=max_subscribers,
    )
    deadline = time.monotonic() + 60
    while "good" not in pub.stats()["subscribers"]:
        if time.monotonic() > deadline:
            sys.exit("no subscriber named good")
        time.sleep(0.05)
    told = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), told.set()), daemon=True).start()
    print("ready", flush=True)
    step = 0
    end = time.monotonic() + seconds
    while not told.is_set() and time.monotonic() < end:
        pub.publish(*message(step, rows=ROWS, hidden=HIDDEN))
        step += 1
    rejected = -1
    while rejected != pub.stats()["rejected"]:
        rejected = pub.stats()["rejected"]
        time.sleep(0.5)
    alive = pub._thread.is_alive()
    print(json.dumps({"published": step, "alive": alive, "stats": pub.stats()}), flush=True)
    pub.close(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
