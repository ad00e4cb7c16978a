"""Server-sent events of a ``Board``: cheap however many pages are open, and
bounded however slowly they read.

Each snapshot is encoded once per (version, feed state, tap) and the same text
goes to every page: 400 pages that each built and encoded their own pushed
``/api/snapshot`` to 3.4 s. A page's queue is one snapshot long, the latest: a
page that reads slowly skips snapshots while its last send waits, never piles
them up. A page whose send has waited ``slow_s`` (it does not read) is dropped
and counted; nothing more is prepared for it, and its stream ends if the send
ever returns. One task wakes the pages when the board changes, so an idle page
costs nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from consumers.dashboard.board import Board

PING_S = 15.0
"""A comment line after this long without an event keeps proxies and idle timers open."""
MAX_ENCODED = 64
"""Encoded events kept (one per tap asked for; more taps than this: the cache restarts)."""


def dumps(view: dict[str, Any]) -> str:
    """JSON of a view; a NaN or an infinity (a bad number from a peer) becomes null,
    which a browser's ``JSON.parse`` reads (it refuses ``NaN``)."""
    try:
        return json.dumps(view, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(view), allow_nan=False)


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class Events:
    """The ``/events`` streams of one board, and their counters."""

    def __init__(self, board: Board, poll_s: float = 0.2, slow_s: float = 10.0) -> None:
        self.board = board
        self.poll_s = poll_s
        self.slow_s = slow_s
        self.clients = 0
        self.dropped = 0
        """Pages dropped because their send waited ``slow_s``."""
        self._encoded: dict[str | None, tuple[tuple[int, str], bytes]] = {}
        self._sending: dict[int, float] = {}  # page -> when its pending send began
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    def counters(self) -> dict[str, int]:
        return {"clients": self.clients, "dropped": self.dropped}

    def event(self, tap: str | None) -> tuple[tuple[int, str], bytes]:
        """``(key, bytes)`` of the board's snapshot for ``tap``, encoded once per key
        (bytes: the server writes them to every page as they are)."""
        key = (self.board.version, self.board.feed())
        hit = self._encoded.get(tap)
        if hit is not None and hit[0] == key:
            return hit
        view = self.board.view(tap)
        out = (key, f"id: {view['version']}\ndata: {dumps(view)}\n\n".encode())
        if len(self._encoded) >= MAX_ENCODED:
            self._encoded.clear()
        self._encoded[tap] = out
        return out

    async def stream(self, tap: str | None) -> AsyncIterator[bytes]:
        """One page's events: the latest snapshot whenever the board changes."""
        me = next(self._ids)
        self.clients += 1
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        try:
            yield b"retry: 1000\n\n"
            seen = None
            while not self.board.closed.is_set():
                changed = self._changed
                key, text = self.event(tap)
                if key == seen:
                    try:
                        await asyncio.wait_for(changed.wait(), PING_S)
                        continue
                    except TimeoutError:
                        text = b": ping\n\n"
                seen = key
                self._sending[me] = time.monotonic()
                yield text  # returns once the page's transport took it
                if self._sending.pop(me, None) is None:
                    return  # dropped while the send waited
        finally:
            self.clients -= 1
            self._sending.pop(me, None)

    async def _watch(self) -> None:
        """Wakes the pages when the board changes; drops the pages that do not read."""
        key = None
        while self.clients and not self.board.closed.is_set():
            now = (self.board.version, self.board.feed())
            if now != key:
                key = now
                self._wake()
            limit = time.monotonic() - self.slow_s
            for page, since in list(self._sending.items()):
                if since < limit:
                    del self._sending[page]
                    self.dropped += 1
            await asyncio.sleep(self.poll_s)
        self._wake()  # closing: every page sees it and ends

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
