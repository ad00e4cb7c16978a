"""Shards and the manifest: how rows become committed, crash-safe files.

A shard is written as ``shard-N.arrow.tmp``, fsynced, renamed, and the directory
fsynced; only then is the manifest (listing its rows, bytes and sha256) replaced
atomically. So after a ``kill -9`` at any moment the run holds committed shards
that match the manifest, at most one complete shard the manifest does not list
yet (killed between rename and manifest), and stray ``.tmp`` files. A restarted
writer deletes the ``.tmp`` files, reads every unlisted shard back and, when it
is whole, adopts it into the manifest (else leaves it, logged and counted), and
numbers new shards after every one on disk: nothing committed is overwritten or
written twice.

A write that fails (disk full, permissions) raises ``StorageError`` naming the
path; the half-written ``.tmp`` is removed and the committed shards stay valid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from actbus.experts import router_info
from actbus.streams import ROUTER_HOOK, point_key
from consumers.fs import layout
from consumers.fs.reductions import Encoder, Reduction, fit_pca, load_basis, save_basis
from consumers.fs.rows import TapRows

log = logging.getLogger("actbus.fs_sink")
# Pending rows are appended to the open shard file once they reach either size.
CHUNK_BYTES = 4 << 20
CHUNK_ROWS = 8192


class StorageError(RuntimeError):
    """The run directory cannot be written; what is committed is intact."""


@dataclass(frozen=True)
class WriterConfig:
    shard_rows: int = 65536
    shard_bytes: int = 256 << 20
    flush_s: float = 5.0
    compression: str = "none"
    ipc: str = "file"
    reduction: Reduction = field(default_factory=Reduction)
    tag_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.shard_rows < 1:
            raise ValueError(f"--shard-rows must be >= 1, got {self.shard_rows}")
        if self.shard_bytes < 1:
            raise ValueError("--shard-mb must be above 0")
        if self.compression not in layout.COMPRESSIONS:
            raise ValueError(
                f"--compression {self.compression!r}: expected one of {layout.COMPRESSIONS}"
            )
        if self.ipc not in layout.IPC_FORMATS:
            raise ValueError(f"--ipc {self.ipc!r}: expected one of {layout.IPC_FORMATS}")


@dataclass
class _Shard:
    """A shard being written: its open ``.tmp`` file and what it holds so far."""

    key: tuple[int, str]
    final: Path
    schema: pa.Schema
    since: float
    file: Any = None
    writer: Any = None
    pending: list[pa.RecordBatch] = field(default_factory=list)
    pending_bytes: int = 0
    rows: int = 0
    nbytes: int = 0
    steps: tuple[int, int] = (1 << 62, -1)
    stream: int = 0

    @property
    def tmp(self) -> Path:
        return self.final.with_name(self.final.name + ".tmp")


@dataclass
class _Tap:
    """Per (layer, hook): its encoder, and for PCA the rows held until the fit."""

    encoder: Encoder
    schema: pa.Schema | None = None
    warmup: list[TapRows] = field(default_factory=list)
    warmup_rows: int = 0


class ShardWriter:
    """Owns one run directory (an exclusive lock) and its manifest."""

    def __init__(self, out: str | Path, cfg: WriterConfig) -> None:
        self.out = Path(out)
        self.cfg = cfg
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.out / ".lock", "w")  # noqa: SIM115 (held for the writer's life)
        except OSError as e:
            raise StorageError(f"--out {self.out}: cannot create the run directory: {e}") from e
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(
                f"--out {self.out}: another fs-sink is writing this run; give each sink its "
                "own directory"
            ) from None
        # Left by a crash mid-write; only the sink's own (--out may hold other files).
        own = [p for p, _ in layout.shard_files(self.out, ".tmp")]
        own += self.out.glob("reductions/*.tmp")
        own += self.out.glob(layout.MANIFEST + ".tmp")
        for stale in own:
            stale.unlink()
        self.counts: Counter[str] = Counter()
        try:
            self.manifest = self._load_manifest()
        except Exception:
            self._lock.close()
            raise
        self._open: dict[tuple[int, str], _Shard] = {}
        self._taps: dict[tuple[int, str], _Tap] = {}
        self._stream = max(0, len(self.manifest.get("streams", [])) - 1)
        """The manifest's index of the publisher whose rows arrive now (``streams``)."""
        self.failed: StorageError | None = None
        self._mlock = threading.RLock()  # the manifest and counters, shared with the committer
        self._options = pa.ipc.IpcWriteOptions(
            compression=None if cfg.compression == "none" else cfg.compression
        )
        self._adopt_orphans()
        self._commits: queue.Queue[_Shard | None] = queue.Queue(maxsize=1)
        self._committer = threading.Thread(
            target=self._commit_loop, name="fs-sink-commit", daemon=True
        )
        self._committer.start()

    # ---------------------------------------------------------------- manifest
    def _load_manifest(self) -> dict[str, Any]:
        cfg = self.cfg
        settings = {
            "ipc": cfg.ipc,
            "compression": cfg.compression,
            "reduction": cfg.reduction.to_json(),
            "tag_columns": list(cfg.tag_columns),
        }
        m = layout.read_manifest(self.out)
        if m is None:
            return {
                "format": layout.FORMAT_VERSION,
                "model": None,
                "hidden_size": None,
                "dtype": None,
                **settings,
                "layers": [],
                "hooks": [],
                "shards": [],
                "bases": {},
                "rows": {},
                "total_rows": 0,
                "sessions": 0,
                "streams": [],
                "counters": {},
            }
        if m.get("format") != layout.FORMAT_VERSION:
            raise RuntimeError(
                f"--out {self.out}: manifest format {m.get('format')!r}, this sink writes "
                f"{layout.FORMAT_VERSION}; use a new directory"
            )
        for key, value in settings.items():
            if key == "compression":  # per shard: each entry names its own
                m[key] = value
            elif m.get(key) != value:
                raise RuntimeError(
                    f"--out {self.out}: the run was written with {key}={m.get(key)!r}, "
                    f"not {value!r}; pass the same flags to continue it, or use a new directory"
                )
        return m

    def write_manifest(self) -> None:
        with self._mlock:
            for _ in range(10):  # the main thread may add a counter meanwhile
                try:
                    self.manifest["counters"] = dict(self.counts)
                    data = json.dumps(self.manifest, indent=1).encode()
                    break
                except RuntimeError:
                    continue
            try:
                layout.write_atomic(self.out / layout.MANIFEST, data)
            except OSError as e:
                (self.out / (layout.MANIFEST + ".tmp")).unlink(missing_ok=True)
                raise self._fail(f"cannot write {self.out / layout.MANIFEST}", e) from e

    def set_stream(self, info: dict[str, Any]) -> None:
        """Check the publisher's stream against the run's; record it."""
        m = self.manifest
        for key in ("model", "hidden_size", "dtype"):
            if m[key] is not None and info.get(key) is not None and m[key] != info[key]:
                raise RuntimeError(
                    f"--out {self.out}: holds a run of {key}={m[key]!r}, but the publisher "
                    f"sends {key}={info[key]!r}; use a new directory"
                )
            m[key] = m[key] if m[key] is not None else info.get(key)
        try:
            router = router_info(info)
        except ValueError as e:  # a peer's WELCOME: its router rows are still stored
            log.warning("the run's manifest leaves out the publisher's router: %s", e)
            router = None
        if router is not None:
            m["router"] = {"num_experts": router[0], "top_k": router[1]}
        m["sessions"] = m.get("sessions", 0) + 1
        # Each publisher (an engine run, a replay) numbers its steps from 0: a new one
        # starts a new stream, and no shard holds rows of two (replay keeps them apart).
        pid = info.get("publisher_id")
        pid = pid[:64] if isinstance(pid, str) else None
        streams = m.setdefault("streams", [])
        if not streams or streams[-1] != pid:
            self._start_stream(pid)
        self._stream = len(streams) - 1
        self.write_manifest()  # the run directory shows the sink is subscribed

    def split_stream(self) -> None:
        """Start a new stream under the current publisher id: its steps went back, so
        these rows are another run's (a restarted publisher that kept, or forged, the
        id); merged, the two would be one stream to ``replay`` and ``verify``."""
        streams = self.manifest.setdefault("streams", [])
        self._start_stream(streams[-1] if streams else None)
        self._stream = len(streams) - 1
        self.counts["streams_split"] += 1
        self.write_manifest()

    def _start_stream(self, pid: str | None) -> None:
        for key in list(self._open):
            self._rotate(key)
        self._commits.join()
        self.manifest.setdefault("streams", []).append(pid)

    def _adopt_orphans(self) -> None:
        listed = {s["path"] for s in self.manifest["shards"]}
        names = [s["path"].rsplit("/", 1)[-1] for s in self.manifest["shards"]]
        changed = False
        for p, (layer, hook) in layout.shard_files(self.out):
            names.append(p.name)
            rel = str(p.relative_to(self.out))
            if rel in listed:
                continue
            try:
                layout.inside(self.out, p)  # never adopt a file a symlink leads out to
                table = layout.read_shard(p, self.cfg.ipc)
                entry = self._entry(p, layer, hook, table)
            except (OSError, pa.ArrowException, ValueError) as e:
                self.counts["orphans_unreadable"] += 1
                log.error("%s: not in the manifest and unreadable (%s); left as is", p, e)
                continue
            self._record(entry)
            self.counts["orphans_adopted"] += 1
            log.info("%s: complete but not in the manifest (a crash); adopted", rel)
            changed = True
        idx = [i for n in names if (i := layout.shard_index(n)) is not None]
        self._next_index = 1 + max(idx, default=-1)
        if changed:
            self.write_manifest()

    # ------------------------------------------------------------------- rows
    def add(self, rows: TapRows) -> None:
        """Buffer rows; a shard is written once its buffer is full. Rows whose layer
        or hook would not make a path inside the run are refused (``UnsafePath``)."""
        if not len(rows):
            return
        key = (rows.layer, rows.hook)
        if key not in self._taps:
            layout.shard_dir(self.out, *key)
        tap = self._tap(key, rows)
        if not tap.encoder.ready:
            tap.warmup.append(rows)
            tap.warmup_rows += len(rows)
            if tap.warmup_rows < self.cfg.reduction.warmup:
                return
            self._fit(key, tap)
            held, tap.warmup, tap.warmup_rows = tap.warmup, [], 0
            for r in held:
                self._append(key, tap, r)
            return
        self._append(key, tap, rows)

    def _tap(self, key: tuple[int, str], rows: TapRows) -> _Tap:
        tap = self._taps.get(key)
        if tap is None:
            hidden = rows.tensor.shape[1]
            basis = None
            # Router rows are expert ids and weights, not activations: stored as they
            # came whatever the run's reduction (an int8 or PCA id is no id).
            spec = Reduction() if key[1] == ROUTER_HOOK else self.cfg.reduction
            entry = self.manifest["bases"].get(point_key(*key))
            if spec.kind == "pca" and entry is not None:
                basis = load_basis(self.out / entry["path"])  # a restart keeps its basis
            tap = self._taps[key] = _Tap(Encoder(spec, rows.dtype, hidden, basis))
        return tap

    def _fit(self, key: tuple[int, str], tap: _Tap) -> None:
        x = torch.cat([r.tensor for r in tap.warmup])
        mean, basis = fit_pca(x, self.cfg.reduction.k)
        path = layout.basis_path(self.out, *key)
        try:
            path.parent.mkdir(exist_ok=True)
            save_basis(path, mean, basis)
        except OSError as e:
            raise self._fail(f"cannot write the PCA basis {path}", e) from e
        tap.encoder.basis = (mean, basis)
        self.manifest["bases"][point_key(*key)] = {
            "path": str(path.relative_to(self.out)),
            "checksum": layout.checksum(path),
            "fitted_rows": int(x.shape[0]),
        }
        self.write_manifest()

    def _schema(self, tap: _Tap, key: tuple[int, str]) -> pa.Schema:
        if tap.schema is None:
            basis = self.manifest["bases"].get(point_key(*key), {}).get("path", "")
            fields = list(layout.META_FIELDS)
            fields += [pa.field(layout.tag_column(k), pa.string()) for k in self.cfg.tag_columns]
            fields += tap.encoder.fields(basis)
            meta = {
                "actbus.format": str(layout.FORMAT_VERSION),
                "actbus.dtype": tap.encoder.dtype,
                "actbus.hidden_size": str(tap.encoder.hidden),
                "actbus.reduction": json.dumps(tap.encoder.spec.to_json()),
            }
            if key[1] == ROUTER_HOOK:
                meta["actbus.top_k"] = str(tap.encoder.hidden // 2)
            tap.schema = pa.schema(fields, metadata=meta)
        return tap.schema

    def _append(self, key: tuple[int, str], tap: _Tap, rows: TapRows) -> None:
        n = len(rows)
        cols: list[pa.Array] = [
            pa.array(rows.request_ids, pa.string()),
            pa.array(rows.sample_index, pa.int32()),
            pa.array(rows.positions, pa.int64()),
            pa.array(rows.token_ids, pa.int64()),
            pa.array(np.full(n, rows.step, dtype=np.int64)),
            pa.array(np.full(n, rows.layer, dtype=np.int32)),
            pa.array([rows.hook] * n, pa.string()),
            pa.array(rows.tags_json(), pa.string()),
        ]
        for k in self.cfg.tag_columns:
            cols.append(pa.array([_tag_value(t.get(k)) for t in rows.tags], pa.string()))
        cols += tap.encoder.encode(rows.tensor)
        rb = pa.record_batch(cols, schema=self._schema(tap, key))
        self._buffered(key, rb, rows.step)

    # ----------------------------------------------------------------- writing
    def _buffered(self, key: tuple[int, str], rb: pa.RecordBatch, step: int) -> None:
        self._check()
        shard = self._open.get(key)
        if shard is None:
            shard = self._open[key] = self._start(key, rb.schema)
        shard.pending.append(rb)
        shard.pending_bytes += rb.nbytes
        shard.rows += rb.num_rows
        shard.nbytes += rb.nbytes
        shard.steps = (min(shard.steps[0], step), max(shard.steps[1], step))
        self.counts["rows_buffered"] += rb.num_rows
        if shard.pending_bytes >= CHUNK_BYTES or sum(b.num_rows for b in shard.pending) >= (
            CHUNK_ROWS
        ):
            self._write_pending(shard)
        if shard.rows >= self.cfg.shard_rows or shard.nbytes >= self.cfg.shard_bytes:
            self._rotate(key)

    def _start(self, key: tuple[int, str], schema: pa.Schema) -> _Shard:
        """A new shard, opened lazily (on its first write) as ``shard-N.arrow.tmp``."""
        d = layout.shard_dir(self.out, *key)
        final = d / layout.shard_name(self._next_index)
        self._next_index += 1
        return _Shard(
            key=key, final=final, schema=schema, since=time.monotonic(), stream=self._stream
        )

    def _write_pending(self, shard: _Shard) -> None:
        """Append the pending record batches to the shard's open file: the kernel
        writes back while more rows arrive, instead of in one burst at rotation."""
        if not shard.pending:
            return
        try:
            if shard.writer is None:
                shard.final.parent.mkdir(parents=True, exist_ok=True)
                shard.file = pa.OSFile(str(shard.tmp), "wb")
                new = pa.ipc.new_file if self.cfg.ipc == "file" else pa.ipc.new_stream
                shard.writer = new(shard.file, shard.schema, options=self._options)
            if (
                len(shard.pending) == 1
                or shard.pending_bytes >= CHUNK_BYTES * len(shard.pending) / 4
            ):
                for rb in shard.pending:  # large batches: written as they came, no copy
                    shard.writer.write_batch(rb)
            else:  # many small messages: one larger record batch
                shard.writer.write_table(pa.Table.from_batches(shard.pending).combine_chunks())
        except (OSError, pa.ArrowException) as e:
            self._abandon(shard)
            raise self._fail(f"cannot write shard {shard.final}", e) from e
        shard.pending, shard.pending_bytes = [], 0

    def _abandon(self, shard: _Shard) -> None:
        self._open.pop(shard.key, None)
        self.counts["rows_lost_on_storage_error"] += shard.rows
        with contextlib.suppress(Exception):
            if shard.writer is not None:
                shard.writer.close()
        with contextlib.suppress(Exception):
            if shard.file is not None:
                shard.file.close()
        shard.tmp.unlink(missing_ok=True)

    def _rotate(self, key: tuple[int, str]) -> None:
        """Finish the shard's file and hand it to the committer thread."""
        shard = self._open.get(key)
        if shard is None:
            return
        self._write_pending(shard)
        try:
            shard.writer.close()
            shard.file.close()
        except (OSError, pa.ArrowException) as e:
            self._abandon(shard)
            raise self._fail(f"cannot write shard {shard.final}", e) from e
        del self._open[key]
        self._commits.put(shard)  # blocks while one shard is still being committed
        self._check()

    def tick(self) -> None:
        """Rotate shards whose first row is ``flush_s`` old. Only age and size rotate a
        shard: a stream that often catches up (a trickle of small steps) still makes
        few, large shards, its small messages batched into larger record batches."""
        self._check()
        now = time.monotonic()
        for key, shard in list(self._open.items()):
            if now - shard.since >= self.cfg.flush_s:
                self._rotate(key)

    def flush(self, final: bool = False) -> None:
        """Commit every open shard and wait for it; ``final`` also fits PCA on a
        short warm-up."""
        if final:
            for key, tap in self._taps.items():
                if tap.warmup:
                    self._fit(key, tap)
                    held, tap.warmup, tap.warmup_rows = tap.warmup, [], 0
                    for r in held:
                        self._append(key, tap, r)
        for key in list(self._open):
            self._rotate(key)
        self._commits.join()
        self._check()

    def close(self) -> None:
        try:
            if self.failed is None:
                self.flush(final=True)
                self.write_manifest()  # final counters
        finally:
            for shard in list(self._open.values()):
                self._abandon(shard)
            self._commits.put(None)
            self._committer.join(timeout=60)
            self._lock.close()
            if self.failed is not None:
                self.counts["rows_lost_on_storage_error"] += sum(
                    t.warmup_rows for t in self._taps.values()
                )
                log.error(
                    "--out %s: %d rows received were not stored (storage error)",
                    self.out,
                    self.counts["rows_lost_on_storage_error"],
                )

    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def _commit_loop(self) -> None:
        """Committer thread: fsync, rename, fsync the directory, list in the manifest."""
        while True:
            shard = self._commits.get()
            try:
                if shard is None:
                    return
                if self.failed is None:
                    self._commit(shard)
                else:  # queued behind the shard that failed
                    shard.tmp.unlink(missing_ok=True)
                    with self._mlock:
                        self.counts["rows_lost_on_storage_error"] += shard.rows
            except StorageError:
                pass  # self.failed is set; the main thread raises it
            except Exception as e:  # never die silently: the main thread reports it
                self._fail(f"cannot commit shard {shard.final}", e)
            finally:
                self._commits.task_done()

    def _commit(self, shard: _Shard) -> None:
        try:
            fd = os.open(shard.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(shard.tmp, shard.final)
            layout.fsync_dir(shard.final.parent)
        except OSError as e:
            shard.tmp.unlink(missing_ok=True)
            with self._mlock:
                self.counts["rows_lost_on_storage_error"] += shard.rows
            raise self._fail(f"cannot write shard {shard.final}", e) from e
        entry = {
            "path": str(shard.final.relative_to(self.out)),
            "layer": shard.key[0],
            "hook": shard.key[1],
            "rows": shard.rows,
            "bytes": shard.final.stat().st_size,
            "checksum": layout.checksum(shard.final),
            "steps": list(shard.steps),
            "stream": shard.stream,
            "compression": self.cfg.compression,
        }
        with self._mlock:
            self._record(entry)
            self.counts["rows_written"] += shard.rows
            self.counts["shards_written"] += 1
        self.write_manifest()

    def _entry(self, path: Path, layer: int, hook: str, table: pa.Table) -> dict[str, Any]:
        steps = table.column("step")
        return {
            "path": str(path.relative_to(self.out)),
            "layer": layer,
            "hook": hook,
            "rows": table.num_rows,
            "bytes": path.stat().st_size,
            "checksum": layout.checksum(path),
            "steps": [int(pc.min(steps).as_py() or 0), int(pc.max(steps).as_py() or 0)],
            "stream": self._stream,  # left by the last sink: its stream, as far as known
        }

    def _record(self, entry: dict[str, Any]) -> None:
        m = self.manifest
        m["shards"].append(entry)
        rk = point_key(entry["layer"], entry["hook"])
        m["rows"][rk] = m["rows"].get(rk, 0) + entry["rows"]
        m["total_rows"] += entry["rows"]
        m["layers"] = sorted(set(m["layers"]) | {entry["layer"]})
        m["hooks"] = sorted(set(m["hooks"]) | {entry["hook"]})

    def _fail(self, what: str, e: Exception) -> StorageError:
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
        self.failed = StorageError(
            f"--out {self.out}: {what}: {why}. {self._listed_on_disk()}; free space or "
            "fix permissions, then restart the sink with the same --out to continue the run"
        )
        log.error("%s", self.failed)
        return self.failed

    def _listed_on_disk(self) -> str:
        """What the manifest on disk lists (after a storage error, memory may list a
        shard whose manifest update never reached the disk)."""
        path = self.out / layout.MANIFEST
        try:
            m = layout.read_manifest(self.out)
        except (OSError, ValueError) as e:
            return f"{path} cannot be read back ({e})"
        if m is None:
            return f"{path} was never written: no shard is committed"
        return f"The {len(m.get('shards', []))} shards listed in {path} are complete and intact"


def _tag_value(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else json.dumps(v)
