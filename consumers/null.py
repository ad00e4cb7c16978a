"""The null consumer: receives, counts and discards. For benchmarks and health checks.

``--fail-at N`` makes it raise on its N-th batch: a fault drill for ``actbus run
--on-error`` (and its tests), never useful otherwise. ``--work-ms T`` holds each
batch for T ms, as a consumer with real work (a trainer step) would: a slow
subscriber for benchmarks and drills.
"""

from __future__ import annotations

import argparse
import dataclasses
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

    def __init__(self, fail_at: int = 0, work_ms: float = 0.0, hooks: str = "") -> None:
        self.hooks = tuple(h for h in hooks.split(",") if h)
        self.fail_at = fail_at
        self.work_s = work_ms / 1e3
        self.messages = 0
        self.rows = 0
        self.bytes = 0
        self.first: float | None = None
        self.last: float | None = None
        self.publisher_dropped: dict[str, int] = {}

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--fail-at",
            type=int,
            default=0,
            metavar="N",
            help="fault drill: raise on the N-th batch of each instance (0: never)",
        )
        parser.add_argument(
            "--work-ms",
            type=float,
            default=0.0,
            metavar="T",
            help="hold each batch T ms, like a consumer with real work (default 0)",
        )
        parser.add_argument(
            "--hooks",
            default="",
            help="comma-separated hooks to receive (default: every activation hook; "
            "router rows and monitor scores come only when named)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NullConsumer:
        return cls(fail_at=args.fail_at, work_ms=args.work_ms, hooks=args.hooks)

    def subscription(self, *args: Any, **kwargs: Any):
        sub = super().subscription(*args, **kwargs)
        return dataclasses.replace(sub, hooks=self.hooks) if self.hooks else sub

    def on_batch(self, batch: Batch) -> None:
        if self.messages + 1 == self.fail_at:
            raise RuntimeError(f"fault drill: --fail-at {self.fail_at}, step {batch.step}")
        now = time.monotonic()
        self.first = self.first or now
        self.last = now
        self.messages += 1
        self.rows += batch.header.rows.num_rows
        self.bytes += batch.header.nbytes
        if self.work_s:
            time.sleep(self.work_s)

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
                    "last_monotonic": self.last,  # the system's clock: benchmarks time to it
                    "dropped_by_publisher": self.publisher_dropped,
                }
            ),
            file=sys.stdout,
            flush=True,
        )
