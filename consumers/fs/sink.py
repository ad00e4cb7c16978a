"""The filesystem sink: the stream to sharded Arrow IPC files plus a manifest.

Rows are buffered per (layer, hook) and written as one shard when the buffer
reaches ``--shard-rows`` or ``--shard-mb``, when ``--flush-s`` has passed since its
first row, when the publisher shows we are caught up, and at the end. A shard is
written under a temporary name and renamed when complete, then the manifest is
replaced atomically, so a reader never sees a partial shard.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actbus.bus import Batch
from actbus.consumer import Consumer
from consumers.fs import layout

log = logging.getLogger("actbus.fs_sink")


@dataclass
class _Buffer:
    batches: list[pa.RecordBatch] = field(default_factory=list)
    rows: int = 0
    nbytes: int = 0
    since: float = 0.0


class FsSink(Consumer):
    """Writes every received row to ``OUT`` as Arrow shards."""

    name = "fs-sink"
    default_policy = "block"  # a dataset should lose nothing

    def __init__(
        self,
        out: str | Path,
        *,
        shard_rows: int = 65536,
        shard_mb: float = 256.0,
        flush_s: float = 5.0,
    ) -> None:
        self.out = Path(out)
        self.shard_rows = shard_rows
        self.shard_bytes = int(shard_mb * (1 << 20))
        self.flush_s = flush_s
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.out / ".lock", "w")  # noqa: SIM115 (held for the sink's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(
                f"--out {self.out}: another fs-sink is writing this run; give each sink its "
                "own directory"
            ) from None
        for stale in self.out.rglob("*.tmp"):  # left by a crash mid-write
            stale.unlink()
        self.manifest: dict[str, Any] = layout.read_manifest(self.out) or {
            "format": layout.FORMAT_VERSION,
            "model": None,
            "hidden_size": None,
            "dtype": None,
            "layers": [],
            "hooks": [],
            "shards": [],
            "rows": {},
            "total_rows": 0,
        }
        # Shards on disk count too: a crash between a shard's rename and the manifest's
        # update leaves one the manifest does not list, and it must not be overwritten.
        on_disk = [p.name for p in self.out.glob("layer-*/*/shard-*.arrow")]
        listed = [Path(s["path"]).name for s in self.manifest["shards"]]
        self._next_index = 1 + max((int(n[6:12]) for n in on_disk + listed), default=-1)
        self._buffers: dict[tuple[int, str], _Buffer] = {}
        self._schemas: dict[tuple[str, int], pa.Schema] = {}
        self.rows_received = 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, help="run directory to write shards into")
        parser.add_argument("--shard-rows", type=int, default=65536, help="rows per shard")
        parser.add_argument("--shard-mb", type=float, default=256.0, help="MiB per shard")
        parser.add_argument(
            "--flush-s", type=float, default=5.0, help="longest a row waits in memory"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FsSink:
        return cls(
            args.out, shard_rows=args.shard_rows, shard_mb=args.shard_mb, flush_s=args.flush_s
        )

    # ------------------------------------------------------------------ events
    def on_welcome(self, info: dict[str, Any]) -> None:
        m = self.manifest
        for key in ("model", "hidden_size", "dtype"):
            if m[key] is not None and info.get(key) is not None and m[key] != info[key]:
                raise RuntimeError(
                    f"--out {self.out}: holds a run of {key}={m[key]!r}, but the publisher "
                    f"sends {key}={info[key]!r}; use a new directory"
                )
            m[key] = m[key] if m[key] is not None else info.get(key)
        self._write_manifest()  # the run directory shows the sink is subscribed

    def on_batch(self, batch: Batch) -> None:
        h = batch.header
        rows = h.rows
        n = rows.num_rows
        if n == 0:
            return
        key = (h.layer, h.hook)
        sch = self._schema(h.dtype, h.shape[1])
        rb = pa.record_batch(
            [
                pa.array(rows.row_request_ids(), pa.string()),
                pa.array(rows.positions, pa.int64()),
                pa.array(rows.token_ids, pa.int64()),
                pa.array(np.full(n, h.step, dtype=np.int64)),
                pa.array(np.full(n, h.layer, dtype=np.int32)),
                pa.array([h.hook] * n, pa.string()),
                layout.tensor_to_arrow(batch.tensor),
            ],
            schema=sch,
        )
        buf = self._buffers.setdefault(key, _Buffer())
        if not buf.batches:
            buf.since = time.monotonic()
        buf.batches.append(rb)
        buf.rows += n
        buf.nbytes += rb.nbytes
        self.rows_received += n
        if buf.rows >= self.shard_rows or buf.nbytes >= self.shard_bytes:
            self._flush(key)

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        now = time.monotonic()
        for key, buf in list(self._buffers.items()):
            if buf.batches and (caught_up or now - buf.since >= self.flush_s):
                self._flush(key)

    def on_end(self) -> None:
        self.flush()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._lock.close()

    # ----------------------------------------------------------------- writing
    def flush(self) -> None:
        for key in list(self._buffers):
            self._flush(key)

    def _schema(self, dtype: str, hidden: int) -> pa.Schema:
        if (dtype, hidden) not in self._schemas:
            self._schemas[(dtype, hidden)] = layout.schema(dtype, hidden)
        return self._schemas[(dtype, hidden)]

    def _flush(self, key: tuple[int, str]) -> None:
        buf = self._buffers.pop(key, None)
        if buf is None or not buf.batches:
            return
        layer, hook = key
        d = layout.shard_dir(self.out, layer, hook)
        d.mkdir(parents=True, exist_ok=True)
        final = d / layout.shard_name(self._next_index)
        self._next_index += 1
        tmp = final.with_name(final.name + ".tmp")
        table = pa.Table.from_batches(buf.batches)
        with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table, max_chunksize=max(1, table.num_rows))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(d)
        steps = table.column("step")
        m = self.manifest
        m["shards"].append(
            {
                "path": str(final.relative_to(self.out)),
                "layer": layer,
                "hook": hook,
                "rows": table.num_rows,
                "bytes": final.stat().st_size,
                "steps": [int(pc.min(steps).as_py()), int(pc.max(steps).as_py())],
            }
        )
        rk = f"{layer}/{hook}"
        m["rows"][rk] = m["rows"].get(rk, 0) + table.num_rows
        m["total_rows"] += table.num_rows
        m["layers"] = sorted(set(m["layers"]) | {layer})
        m["hooks"] = sorted(set(m["hooks"]) | {hook})
        self._write_manifest()

    def _write_manifest(self) -> None:
        layout.write_atomic(
            self.out / layout.MANIFEST, json.dumps(self.manifest, indent=1).encode()
        )


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
