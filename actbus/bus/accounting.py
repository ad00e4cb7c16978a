"""What the publisher counts, per subscriber and overall.

Per subscriber, every message routed to it ends up in exactly one place:
``routed == sent + dropped (all reasons) + pending + spill_depth``. Steps a
``sample`` subscriber did not ask for (``sampled_out``) and messages its ``match`` filter
left empty (``filtered_out``) are not routed to it, so they are neither drops nor
gaps. Drop reasons: ``queue_full`` (drop_newest, sample), ``evicted``
(drop_oldest), ``spill_full`` (spill cap reached, per its fallback), and the ways a
subscriber dies (``disconnected``, ``timeout``, ``left``, ``not_reading``: its
ZeroMQ queue filled, ``send_error``), which drop whatever was still waiting for it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SubCounters:
    """One subscriber's accounting (all counts are messages unless named bytes)."""

    routed: int = 0
    sent: int = 0
    bytes_sent: int = 0
    sampled_out: int = 0
    filtered_out: int = 0
    spilled: int = 0
    replayed: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "routed": self.routed,
            "sent": self.sent,
            "bytes_sent": self.bytes_sent,
            "sampled_out": self.sampled_out,
            "filtered_out": self.filtered_out,
            "spilled": self.spilled,
            "replayed": self.replayed,
            "dropped": dict(self.dropped),
        }


class LatencyWindow:
    """Capture-to-send latencies of the last ``size`` messages, as percentiles."""

    def __init__(self, size: int = 4096) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def summary(self) -> dict[str, float | int]:
        if not self._values:
            return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        a = np.fromiter(self._values, dtype=np.float64) * 1e3
        p50, p99 = np.percentile(a, [50, 99])
        return {
            "n": len(a),
            "p50_ms": round(float(p50), 3),
            "p99_ms": round(float(p99), 3),
            "max_ms": round(float(a.max()), 3),
        }
