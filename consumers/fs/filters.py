"""What the sink stores: a filter on taps and positions, and the marked window.

``StoreFilter`` keeps layers, hooks and a position range (layers and hooks are also
asked of the publisher, so unwanted taps never cross the bus). ``MarkedWindow``
is post-hoc selective storage: recent requests are held in memory and written
only once marked, by tags that match at submission (``--keep-match``) or by a mark
on the bus (``Subscriber.mark``, e.g. a probe that fired). The window is bounded by requests
and bytes; evicted requests, and marks that come too late for them, are counted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actbus.bus.protocol import Subscription
from consumers.fs.rows import TapRows

log = logging.getLogger("actbus.fs_sink")
REMEMBERED = 100_000  # kept / evicted request keys remembered (oldest forgotten first)


@dataclass(frozen=True)
class StoreFilter:
    """The taps and token positions the sink stores (the capture side has its own
    ``actbus.capture.selection.Selection``: what a request asks to be captured)."""

    layers: tuple[int, ...] | None = None
    hooks: tuple[str, ...] | None = None
    position_range: tuple[int, int | None] | None = None
    """``[start, stop)`` of token positions kept (stop None: to the end)."""

    def cut(self, sub: Subscription) -> Subscription:
        """``sub`` asking for these layers and hooks only: unwanted taps never cross
        the bus."""
        return dataclasses.replace(sub, layers=self.layers, hooks=self.hooks)

    def wants(self, layer: int, hook: str) -> bool:
        return (self.layers is None or layer in self.layers) and (
            self.hooks is None or hook in self.hooks
        )

    def position_rows(self, positions: np.ndarray) -> np.ndarray | None:
        """Indices of rows in the position range; None when all are kept."""
        if self.position_range is None:
            return None
        start, stop = self.position_range
        ok = positions >= start
        if stop is not None:
            ok &= positions < stop
        return None if ok.all() else np.flatnonzero(ok)


def parse_position_range(text: str) -> tuple[int, int | None]:
    """``START:STOP`` (either may be empty): token positions kept, STOP excluded."""
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo = int(start) if start else 0
        hi = int(stop) if stop else None
    except ValueError:
        raise ValueError(f"--positions {text!r}: expected START:STOP, e.g. 0:128 or 16:") from None
    if lo < 0 or (hi is not None and hi <= lo):
        raise ValueError(f"--positions {text!r}: need 0 <= START < STOP")
    return lo, hi


def parse_keep_match(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items, the request tags that keep a request at once; VALUE is read
    as JSON when it parses (``keep=true`` is the boolean), else as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--keep-match {item!r}: expected KEY=VALUE, e.g. keep=true")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@dataclass
class _Held:
    rows: list[TapRows] = field(default_factory=list)
    nbytes: int = 0


class MarkedWindow:
    """Holds recent requests until marked; gives back the rows to store."""

    def __init__(self, max_requests: int, max_bytes: int, keep_match: dict[str, Any]) -> None:
        if max_requests < 1 or max_bytes < 1:
            raise ValueError(
                f"--window-requests {max_requests} / --window-mb-held {max_bytes / (1 << 20):g}: "
                "both must be above 0"
            )
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.keep_match = keep_match
        """Request tags that keep a request as soon as its rows arrive (empty: none)."""
        self._held: OrderedDict[tuple[str, int], _Held] = OrderedDict()
        self._bytes = 0
        self._kept: OrderedDict[tuple[str, int], str] = OrderedDict()  # key -> why
        self._evicted: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def _matches(self, tags: dict[str, Any]) -> bool:
        return bool(self.keep_match) and all(tags.get(k) == v for k, v in self.keep_match.items())

    def offer(self, rows: TapRows) -> list[TapRows]:
        """Rows to store now (of requests already kept); the others are held."""
        out = []
        for key, idx in rows.by_request().items():
            part = rows.take(idx) if len(idx) != len(rows) else rows
            if key not in self._kept and self._matches(part.tags[0]):
                self._keep(key, "tag")
                self.counts["kept_by_tag"] += 1
            if key in self._kept:
                out.append(part)
                continue
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _Held()
            held.rows.append(part)
            held.nbytes += part.nbytes
            self._bytes += part.nbytes
            self.counts["rows_held"] += len(part)
        self._evict()
        return out

    def mark(self, request_id: str, sample_index: int, reason: str = "") -> list[TapRows]:
        """Keep a request: its held rows are returned, its later rows stored."""
        key = (request_id, sample_index)
        self.counts["marks"] += 1
        if key in self._kept:
            self.counts["marks_repeated"] += 1
            return []
        self._keep(key, "mark")
        # Evicted before, even if later rows of it are held again: its first rows are lost.
        evicted = key in self._evicted
        if evicted:
            self.counts["marks_after_eviction"] += 1
            log.warning(
                "mark for %s/%d (%s) came after it left the window: its earlier rows are "
                "lost, later ones are kept; a larger --window-requests/--window-mb-held holds it",
                request_id,
                sample_index,
                reason or "no reason",
            )
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= held.nbytes
            self.counts["kept_by_mark"] += 1
            return held.rows
        if not evicted:
            self.counts["marks_before_rows"] += 1  # kept once its rows arrive
        return []

    def _keep(self, key: tuple[str, int], why: str) -> None:
        self._kept[key] = why
        while len(self._kept) > REMEMBERED:
            self._kept.popitem(last=False)

    def _evict(self) -> None:
        while self._held and (len(self._held) > self.max_requests or self._bytes > self.max_bytes):
            key, held = self._held.popitem(last=False)
            self._bytes -= held.nbytes
            self.counts["evicted_requests"] += 1
            self.counts["evicted_rows"] += sum(len(r) for r in held.rows)
            self._evicted[key] = None
            while len(self._evicted) > REMEMBERED:
                self._evicted.popitem(last=False)

    def discard(self) -> None:
        """At close: requests never marked are dropped, and counted."""
        self.counts["unmarked_at_close"] += len(self._held)
        self.counts["unmarked_rows_at_close"] += sum(
            len(r) for h in self._held.values() for r in h.rows
        )
        self._held.clear()
        self._bytes = 0

    @property
    def held_requests(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return self._bytes
