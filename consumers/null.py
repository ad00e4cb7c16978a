"""The null consumer: receives, counts and discards. For benchmarks and health checks."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from actbus.bus import Batch
from actbus.consumer import Consumer


class NullConsumer(Consumer):
    """Counts what arrives; prints one JSON line of totals when it stops."""

    name = "null"
    default_policy = "block"

    def __init__(self) -> None:
        self.messages = 0
        self.rows = 0
        self.bytes = 0
        self.first: float | None = None
        self.last: float | None = None
        self.publisher_dropped: dict[str, int] = {}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NullConsumer:
        return cls()

    def on_batch(self, batch: Batch) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now
        self.messages += 1
        self.rows += batch.header.rows.num_rows
        self.bytes += batch.header.nbytes

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        self.publisher_dropped = dict(info.get("dropped") or {})

    def close(self) -> None:
        span = (self.last - self.first) if self.first and self.last else 0.0
        print(
            json.dumps(
                {
                    "messages": self.messages,
                    "rows": self.rows,
                    "bytes": self.bytes,
                    "seconds": round(span, 3),
                    "dropped_by_publisher": self.publisher_dropped,
                }
            ),
            file=sys.stdout,
            flush=True,
        )
