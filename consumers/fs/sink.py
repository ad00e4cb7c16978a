"""The filesystem sink: the stream to sharded Arrow IPC files plus a manifest.

Rows are buffered per (layer, hook) and written as one shard when the buffer
reaches ``--shard-rows`` or ``--shard-mb``, when ``--flush-s`` has passed since its
first row, when the publisher shows we are caught up, and at the end (see
``writer.py`` for crash safety). Before that, rows pass the store filter (layers,
hooks, positions) and, with ``--keep marked``, the window of unmarked requests
(``selection.py``); the reduction (``reductions.py``) is applied as rows are
buffered.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from actbus.bus import Batch
from actbus.bus.protocol import Subscription
from actbus.consumer import Consumer
from actbus.flags import int_list
from consumers.fs import layout
from consumers.fs.reductions import parse_reduction
from consumers.fs.rows import TapRows
from consumers.fs.selection import (
    MarkedWindow,
    StoreFilter,
    parse_keep_match,
    parse_position_range,
)
from consumers.fs.writer import ShardWriter, WriterConfig

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
            "--pca-warmup", type=int, default=4096, help="rows per layer/hook the PCA is fitted on"
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
    def from_args(cls, args: argparse.Namespace) -> FsSink:
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
            window = None
            if args.keep == "marked":
                window = MarkedWindow(
                    args.window_requests,
                    int(args.window_mb_held * (1 << 20)),
                    parse_keep_match(args.keep_match),
                )
            elif args.keep_match:
                raise ValueError("--keep-match applies only with --keep marked")
        except ValueError as e:
            raise SystemExit(f"actbus run fs-sink: {e}") from None
        return cls(args.out, cfg, store_filter=store_filter, window=window)

    def subscription(self, *args: Any, **kwargs: Any) -> Subscription:
        """Layers and hooks are cut at the publisher: unwanted taps never cross the bus."""
        sub = super().subscription(*args, **kwargs)
        return dataclasses.replace(
            sub, layers=self.store_filter.layers, hooks=self.store_filter.hooks
        )

    # ------------------------------------------------------------------ events
    def on_welcome(self, info: dict[str, Any]) -> None:
        self.writer.set_stream(info)

    def on_batch(self, batch: Batch) -> None:
        h = batch.header
        if h.rows.num_rows == 0:
            return
        self.rows_received += h.rows.num_rows
        self.counts["rows_received"] += h.rows.num_rows
        if not self.store_filter.wants(h.layer, h.hook):
            self.counts["rows_not_selected"] += h.rows.num_rows
            return
        rows = TapRows.from_batch(batch)
        keep = self.store_filter.position_rows(rows.positions)
        if keep is not None:
            self.counts["rows_not_selected"] += len(rows) - len(keep)
            rows = rows.take(keep)
        if self.window is None:
            self.writer.add(rows)
            return
        for part in self.window.offer(rows):
            self.writer.add(part)
        self._sync_window_counts()

    def on_mark(self, info: dict[str, Any]) -> None:
        if self.window is None:
            return
        rid, index = str(info.get("request_id", "")), int(info.get("sample_index", 0))
        released = self.window.mark(rid, index, str(info.get("reason", "")))
        for part in released:
            self.writer.add(part)
        self._sync_window_counts()
        if released:
            log.info("kept %s/%d (marked by %s)", rid, index, info.get("by") or "?")

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        self.writer.tick(caught_up)

    def on_end(self) -> None:
        self.writer.flush(final=True)

    def close(self) -> None:
        if self.window is not None:
            self.window.discard()
            self._sync_window_counts()
        self.writer.close()

    # ----------------------------------------------------------------- helpers
    def flush(self) -> None:
        self.writer.flush(final=True)

    def _sync_window_counts(self) -> None:
        for k, v in self.window.counts.items():
            self.counts[f"window_{k}"] = v
        self.counts["window_held_requests"] = self.window.held_requests
