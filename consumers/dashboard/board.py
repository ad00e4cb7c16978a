"""What the web server shows: the latest snapshot, shared between two threads.

The consumer thread writes (``WebDashboard.report``, ``RecentRequests.add``); the
server's event loop reads. One lock guards both; the version lets each open page
stream only snapshots it has not seen.
"""

from __future__ import annotations

import threading
from typing import Any

from consumers.stats import RecentRequests


class Board:
    def __init__(self, recent: RecentRequests) -> None:
        self.lock = threading.Lock()
        self.recent = recent
        self.version = 0
        self.closed = threading.Event()
        self._snap: dict[str, Any] = {}

    def publish(self, snap: dict[str, Any]) -> None:
        with self.lock:
            self._snap = snap
            self.version += 1

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
                "tap": tap,
                "requests": self.recent.snapshot(tap),
                "requests_forgotten": self.recent.forgotten,
            }


def _default_tap(taps: list[str]) -> str | None:
    """The residual stream leaving the deepest tapped layer, if tapped; else the last tap."""
    if not taps:
        return None
    deepest = max(int(t.split("/", 1)[0]) for t in taps)
    return f"{deepest}/post_block" if f"{deepest}/post_block" in taps else taps[-1]
