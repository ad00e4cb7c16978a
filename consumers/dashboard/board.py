"""What the web server shows: the latest snapshot, shared between two threads.

The consumer thread writes (``WebDashboard.report``, ``RecentRequests.add``); the
server's event loop reads. One lock guards both; the version lets each open page
stream only snapshots it has not seen. The feed's state says whether the figures
are current: ``live``, ``waiting`` (no snapshot yet), ``stale`` (none for
``stale_s``: the publisher is gone or the consumer is stuck) or ``stopped`` (the
consumer gave up; ``feed_error`` says why).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from actbus.streams import parse_point_key, point_key
from consumers.stats import RecentRequests


class Board:
    def __init__(self, recent: RecentRequests, stale_s: float = 10.0) -> None:
        self.lock = threading.Lock()
        self.recent = recent
        self.version = 0
        self.stale_s = stale_s
        self.closed = threading.Event()
        self.feed_error: str | None = None
        self._snap: dict[str, Any] = {}
        self._updated = time.monotonic()

    def publish(self, snap: dict[str, Any]) -> None:
        with self.lock:
            self._snap = snap
            self.version += 1
            self._updated = time.monotonic()

    def stop(self, why: str) -> None:
        """The consumer gave up for good: the page shows why, not stale figures."""
        with self.lock:
            self.feed_error = why
            self.version += 1

    def feed(self) -> str:
        """``live``, ``waiting``, ``stale`` or ``stopped`` (see the module's docstring)."""
        if self.feed_error is not None:
            return "stopped"
        if time.monotonic() - self._updated > self.stale_s:
            return "stale"
        return "live" if self.version else "waiting"

    def view(self, tap: str | None) -> dict[str, Any]:
        """The latest snapshot, plus recent requests with per-token norms of ``tap``
        (default: the last tapped layer's last hook in the snapshot)."""
        with self.lock:
            snap = self._snap
            taps = list((snap.get("acts") or {}).get("taps") or {})
            if tap not in taps:
                tap = _default_tap(taps)
            return {
                **snap,
                "version": self.version,
                "feed": self.feed(),
                "feed_error": self.feed_error,
                "stale_s": self.stale_s,
                "tap": tap,
                "requests": self.recent.snapshot(tap),
                "requests_forgotten": self.recent.forgotten,
            }


def _default_tap(taps: list[str]) -> str | None:
    """The residual stream leaving the deepest tapped layer, if tapped; else the last tap."""
    if not taps:
        return None
    deepest = point_key(max(parse_point_key(t)[0] for t in taps), "post_block")
    return deepest if deepest in taps else taps[-1]
