"""The fs sink under fan-in: one run per publisher, each in a directory of its own.

``actbus run fs-sink --connect A,B --out DIR`` writes ``DIR/<address>/``, a complete
run per publisher endpoint (its name is the address with every character outside
``[A-Za-z0-9._-]`` made ``_``), each an ordinary ``FsSink`` with its own manifest,
lock, counters and marked window. Why not one merged run: every publisher numbers
its steps from 0 and its rows arrive interleaved with the others', while a run
keeps each publisher's rows in shards of their own (``streams`` in the manifest);
merged, the writer would rotate its shards at each switch of publisher, or hold one
open shard per publisher and tap. A run per publisher keeps the format, the reader,
``actbus replay`` and the trainers' ``--from`` as they are, and a restarted publisher
(a new ``publisher_id`` at the same address) continues its run as a new stream,
exactly as with one publisher.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actbus.bus import Batch
from actbus.bus.protocol import Subscription
from actbus.consumer import Consumer
from actbus.logcap import capped_text
from consumers.fs.filters import StoreFilter

log = logging.getLogger("actbus.fs_sink")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def run_name(address: str) -> str:
    """The directory of ``address``'s run: the address, made a plain file name."""
    return _UNSAFE.sub("_", address).strip("_.") or "publisher"


class PerPublisherSink(Consumer):
    """One ``FsSink`` per publisher, made on its first batch, fed its own rows."""

    name = "fs-sink"
    default_policy = "block"

    def __init__(
        self, out: str | Path, make: Callable[[Path], Consumer], store_filter: StoreFilter
    ) -> None:
        self.out = Path(out)
        self.store_filter = store_filter
        self._make = make
        self.sinks: dict[str, Consumer] = {}
        """By publisher address."""
        self._run_of: dict[str, str | None] = {}  # address -> the publisher_id it writes
        self._welcomes: dict[str, dict[str, Any]] = {}  # publisher_id -> its WELCOME

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Consumer:
        """Not a plugin of its own: ``FsSink.from_args`` (``fs-sink``) makes one."""
        raise NotImplementedError("use FsSink.from_args: it builds this under fan-in")

    def subscription(self, *args: Any, **kwargs: Any) -> Subscription:
        return self.store_filter.cut(super().subscription(*args, **kwargs))

    def on_welcome(self, info: dict[str, Any]) -> None:
        # Kept until that publisher's first batch says which address it is.
        pid = info.get("publisher_id")
        self._welcomes[capped_text(str(pid)) if pid is not None else "None"] = info

    def on_batch(self, batch: Batch) -> None:
        src = batch.source
        if src is None:  # not from a subscriber: nothing to file it under
            return
        sink = self.sinks.get(src.address)
        if sink is None:
            sink = self.sinks[src.address] = self._make(self.out / run_name(src.address))
            log.info("publisher %s: writing its run to %s", src.address, sink.out)
        welcome = self._welcomes.pop(str(src.publisher_id), None)  # as Source caps it
        if welcome is not None or self._run_of.get(src.address, "") != src.publisher_id:
            # A new run, or the same id welcomed again (the sink then checks its steps).
            self._run_of[src.address] = src.publisher_id
            sink.on_welcome(welcome or {})
        sink.on_batch(batch)

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        for sink in self.sinks.values():
            sink.on_heartbeat(info, caught_up)

    def on_mark(self, info: dict[str, Any]) -> None:
        for sink in self.sinks.values():  # a request id is known to one publisher
            sink.on_mark(info)

    def on_rejected(self, rejected_by: dict[str, int]) -> None:
        for sink in self.sinks.values():
            sink.on_rejected(rejected_by)

    def on_end(self) -> None:
        for sink in self.sinks.values():
            sink.on_end()

    def close(self) -> None:
        errors = []
        for sink in self.sinks.values():
            try:
                sink.close()
            except Exception as e:  # close every run, then report the first failure
                errors.append(e)
        if errors:
            raise errors[0]
