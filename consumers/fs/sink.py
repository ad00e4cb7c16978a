"""The filesystem sink: the stream to sharded Arrow IPC files plus a manifest.

Rows are buffered per (layer, hook) and written as one shard when the buffer
reaches ``--shard-rows`` or ``--shard-mb``, when ``--flush-s`` has passed since its
first row, and at the end (see
``writer.py`` for crash safety). Before that, rows pass the store filter (layers,
hooks, positions) and, with ``--keep marked``, the window of unmarked requests
(``filters.py``); the reduction (``reductions.py``) is applied as rows are
buffered.

Whatever arrives, the sink creates, replaces and lists files inside ``--out``
only: headers are checked at decode time (``actbus.wire``; refused messages are
counted in the manifest's counters as ``messages_rejected_FIELD``), and shard
paths are built only from a plain hook and a layer >= 0 and resolved under the
run (``layout.shard_dir``; rows refused there are counted as
``rows_refused_unsafe_path``). A refusal is logged once and the sink goes on.

A publisher numbers its steps from 0 and sends them in order, so a step that goes
back within a stream is another run's: a restarted publisher that kept (or forged) the
``publisher_id`` of the stream being written. The sink never merges the two: it
starts a new stream there (counted as ``streams_split``; ``replay`` keeps streams
apart), once per WELCOME; steps that go back again before the next WELCOME are
refused and counted (``rows_refused_step_order``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from actbus.bus import Batch
from actbus.bus.endpoints import Endpoints
from actbus.bus.protocol import Subscription
from actbus.consumer import Consumer
from actbus.flags import int_list
from actbus.logcap import capped, capped_text
from actbus.wire import MAX_INT32, MAX_REASON_CHARS, MAX_REQUEST_ID_CHARS
from consumers.fs import layout
from consumers.fs.filters import (
    MarkedWindow,
    StoreFilter,
    parse_keep_match,
    parse_position_range,
)
from consumers.fs.per_publisher import PerPublisherSink
from consumers.fs.reductions import parse_reduction
from consumers.fs.rows import TapRows
from consumers.fs.writer import ShardWriter, WriterConfig

UNSAFE = "messages_refused_unsafe_path"

log = logging.getLogger("actbus.fs_sink")


class FsSink(Consumer):
    """Writes the rows it receives (all, or the selected or marked ones) to ``OUT``."""

    name = "fs-sink"
    default_policy = "block"  # a dataset should lose nothing

    def __init__(
        self,
        out: str,
        config: WriterConfig | None = None,
        *,
        store_filter: StoreFilter | None = None,
        window: MarkedWindow | None = None,
        shard_rows: int | None = None,
        flush_s: float | None = None,
    ) -> None:
        cfg = config or WriterConfig()
        if shard_rows is not None or flush_s is not None:  # shorthand for tests and scripts
            cfg = dataclasses.replace(
                cfg,
                shard_rows=shard_rows if shard_rows is not None else cfg.shard_rows,
                flush_s=flush_s if flush_s is not None else cfg.flush_s,
            )
        self.store_filter = store_filter or StoreFilter()
        self.window = window
        self.writer = ShardWriter(out, cfg)
        self.out = self.writer.out
        self.counts = self.writer.counts
        self.rows_received = 0
        self._stream_steps: dict[tuple[int, str], int] = {}  # latest step per tap
        self._split_since_welcome = False

    @property
    def manifest(self) -> dict[str, Any]:
        return self.writer.manifest

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("fs-sink: files")
        g.add_argument("--out", required=True, help="run directory to write shards into")
        g.add_argument("--shard-rows", type=int, default=65536, help="rows per shard")
        g.add_argument("--shard-mb", type=float, default=256.0, help="MiB per shard")
        g.add_argument(
            "--flush-s", type=float, default=5.0, help="longest a row waits in memory (s)"
        )
        g.add_argument(
            "--compression", default="none", choices=layout.COMPRESSIONS, help="per shard"
        )
        g.add_argument(
            "--ipc",
            default="file",
            choices=layout.IPC_FORMATS,
            help="IPC file (pyarrow.dataset, load_dataset('arrow')) or stream "
            "(datasets.Dataset.from_file)",
        )
        g.add_argument(
            "--reduce",
            default="none",
            metavar="R",
            help="storage reduction: none, fp16, bf16, int8, proj:K, pca:K, topk:K",
        )
        g.add_argument("--reduce-seed", type=int, default=0, help="seed of proj:K's matrix")
        g.add_argument(
            "--pca-warmup", type=int, default=4096, help="rows per stream the PCA is fitted on"
        )
        g.add_argument(
            "--tag-columns",
            default="",
            metavar="K1,K2",
            help="request tag keys that also get a column tag_KEY of their own "
            "(all tags are in the JSON column 'tags' anyway)",
        )
        s = parser.add_argument_group("fs-sink: what is stored")
        s.add_argument("--layers", type=int_list, default=None, help="keep only these layers: 0,3")
        s.add_argument("--hooks", default=None, help="keep only these hooks: post_block,mlp_out")
        s.add_argument(
            "--positions", default=None, metavar="START:STOP", help="keep token positions"
        )
        s.add_argument(
            "--keep",
            default="all",
            choices=("all", "marked"),
            help="marked: hold recent requests, store only those kept by --keep-match or a "
            "mark on the bus",
        )
        s.add_argument(
            "--keep-match",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="with --keep marked: requests submitted with tags that match are kept at once",
        )
        s.add_argument(
            "--window-requests", type=int, default=1024, help="--keep marked: requests held"
        )
        s.add_argument("--window-mb-held", type=float, default=1024, help="--keep marked: MiB held")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Consumer:
        """An ``FsSink``; under fan-in (``--connect`` naming several publishers) a
        ``PerPublisherSink`` of one ``FsSink`` run per publisher under ``--out``."""
        try:
            cfg = WriterConfig(
                shard_rows=args.shard_rows,
                shard_bytes=int(args.shard_mb * (1 << 20)),
                flush_s=args.flush_s,
                compression=args.compression,
                ipc=args.ipc,
                reduction=parse_reduction(
                    args.reduce, seed=args.reduce_seed, warmup=args.pca_warmup
                ),
                tag_columns=tuple(k for k in args.tag_columns.split(",") if k),
            )
            store_filter = StoreFilter(
                layers=tuple(args.layers) if args.layers else None,
                hooks=tuple(args.hooks.split(",")) if args.hooks else None,
                position_range=parse_position_range(args.positions) if args.positions else None,
            )
            keep_match = parse_keep_match(args.keep_match)
            if args.keep != "marked" and args.keep_match:
                raise ValueError("--keep-match applies only with --keep marked")
        except ValueError as e:
            raise SystemExit(f"actbus run fs-sink: {e}") from None

        def make(out: str | Path) -> FsSink:
            window = None
            if args.keep == "marked":
                window = MarkedWindow(
                    args.window_requests, int(args.window_mb_held * (1 << 20)), keep_match
                )
            return cls(out, cfg, store_filter=store_filter, window=window)

        connect = getattr(args, "connect", None)
        if connect and Endpoints.parse(connect).fan_in:
            return PerPublisherSink(args.out, make, store_filter)
        return make(args.out)

    def subscription(self, *args: Any, **kwargs: Any) -> Subscription:
        """Layers and hooks are cut at the publisher: unwanted taps never cross the bus."""
        return self.store_filter.cut(super().subscription(*args, **kwargs))

    # ------------------------------------------------------------------ events
    def on_welcome(self, info: dict[str, Any]) -> None:
        before = self.writer.manifest.get("streams", []).copy()
        self.writer.set_stream(info)
        if self.writer.manifest["streams"] != before:
            self._stream_steps.clear()
        self._split_since_welcome = False

    def _in_order(self, layer: int, hook: str, step: int, rows: int) -> bool:
        """Whether a batch continues its stream; a step that goes back starts a new one
        (once per WELCOME) or is refused."""
        key = (layer, hook)
        last = self._stream_steps.get(key)
        if last is not None and step < last:
            if self._split_since_welcome:
                self.counts["rows_refused_step_order"] += rows
                return False
            self.writer.split_stream()
            self._stream_steps.clear()
            self._split_since_welcome = True
            log.warning(
                "step %d of layer %d %s after step %d in the same stream: another run under "
                "publisher id %s; written as a new stream (streams_split)",
                step, layer, capped(hook), last, capped(self.writer.manifest["streams"][-1]),
            )  # fmt: skip
        self._stream_steps[key] = step
        return True

    def on_batch(self, batch: Batch) -> None:
        h = batch.header
        if h.rows.num_rows == 0:
            return
        self.rows_received += h.rows.num_rows
        self.counts["rows_received"] += h.rows.num_rows
        if not self._in_order(h.layer, h.hook, h.step, h.rows.num_rows):
            return
        if not self.store_filter.wants(h.layer, h.hook):
            self.counts["rows_not_selected"] += h.rows.num_rows
            return
        rows = TapRows.from_batch(batch)
        keep = self.store_filter.position_rows(rows.positions)
        if keep is not None:
            self.counts["rows_not_selected"] += len(rows) - len(keep)
            rows = rows.take(keep)
        if self.window is None:
            self._store(rows)
            return
        for part in self.window.offer(rows):
            self._store(part)
        self._sync_window_counts()

    def on_mark(self, info: dict[str, Any]) -> None:
        if self.window is None:
            return
        rid, index = info.get("request_id"), info.get("sample_index", 0)
        if not (
            type(rid) is str
            and len(rid) <= MAX_REQUEST_ID_CHARS
            and type(index) is int
            and 0 <= index <= MAX_INT32
        ):  # a peer's mark: counted and let go, never the end of the sink
            self.counts["marks_refused"] += 1
            if self.counts["marks_refused"] == 1:
                log.warning(
                    "refused a mark of request %s, sample %s: expected a request id of at "
                    "most %d characters and a sample index in [0, 2**31) (counted as "
                    "marks_refused; later ones are not logged)",
                    capped(rid),
                    capped(index),
                    MAX_REQUEST_ID_CHARS,
                )
            return
        reason = capped_text(str(info.get("reason", "")), MAX_REASON_CHARS)
        released = self.window.mark(rid, index, reason)
        for part in released:
            self._store(part)
        self._sync_window_counts()
        if released:
            by = capped_text(str(info.get("by") or "?"), MAX_REASON_CHARS)
            log.info("kept %s/%d (marked by %s)", capped_text(rid), index, by)

    def on_rejected(self, rejected_by: dict[str, int]) -> None:
        """Messages the subscriber refused, by header field: in the run's counters."""
        for field, n in rejected_by.items():
            self.counts[f"messages_rejected_{field}"] = n
        self.counts["messages_rejected"] = sum(rejected_by.values())

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        self.writer.tick()

    def on_end(self) -> None:
        self.writer.flush(final=True)

    def close(self) -> None:
        if self.window is not None:
            self.window.discard()
            self._sync_window_counts()
        self.writer.close()

    # ----------------------------------------------------------------- helpers
    def _store(self, rows: TapRows) -> None:
        """Rows to the writer; rows it refuses as unsafe are counted (the first logged)
        and the sink goes on."""
        try:
            self.writer.add(rows)
        except layout.UnsafePath as e:
            self.counts["rows_refused_unsafe_path"] += len(rows)
            self.counts[UNSAFE] += 1
            if self.counts[UNSAFE] == 1:
                log.error("%s (counted as %s; later ones are not logged)", e, UNSAFE)

    def flush(self) -> None:
        self.writer.flush(final=True)

    def _sync_window_counts(self) -> None:
        for k, v in self.window.counts.items():
            self.counts[f"window_{k}"] = v
        self.counts["window_held_requests"] = self.window.held_requests
