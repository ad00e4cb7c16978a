"""Reading a run the sink wrote: as a pyarrow dataset, one request at a time, or
checked against its manifest.

Opening a run checks each listed shard cheaply (it stays inside the run, its size
is the manifest's, its IPC framing is whole at both ends: a truncated or replaced
shard is caught before any read); ``verify()`` also compares checksums and row
counts. A bad shard raises ``BadShard`` naming it, or with ``skip_bad=True`` is
left out with a warning, so one truncated shard does not make the run unreadable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch

from actbus.experts import router_info
from actbus.streams import ROUTER_HOOK, point_key
from consumers.fs import layout
from consumers.fs.reductions import Decoder, Reduction

log = logging.getLogger("actbus.fs_reader")

# An Arrow IPC file starts with ARROW1 and two bytes of padding and ends with its
# footer's length and ARROW1; a stream ends with the end-of-stream marker.
_FILE_MAGIC = b"ARROW1"
_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class BadShard(RuntimeError):
    """A shard the manifest lists is missing, of the wrong size, or not whole."""


class ActivationRun:
    """A run directory: its manifest and its committed shards.

    Only shards the manifest lists are read: a shard renamed into place by a sink
    killed before its manifest update is invisible here until a restarted sink
    adopts it. Every listed shard is checked on open (see the module's docstring);
    ``skip_bad`` leaves bad ones out (``bad_shards`` names them) instead of raising.
    """

    def __init__(self, path: str | Path, *, skip_bad: bool = False) -> None:
        self.path = Path(path)
        manifest = layout.read_manifest(self.path)
        if manifest is None:
            raise FileNotFoundError(f"{self.path}: no {layout.MANIFEST}; is this an actbus run?")
        self.manifest: dict[str, Any] = manifest
        self.decoder = Decoder(self.path)
        self.bad_shards: dict[str, str] = {}
        """Listed shards left out (``skip_bad``): path -> what is wrong with it."""
        for s in manifest["shards"]:
            why = self._shard_problem(s)
            if why is None:
                continue
            if not skip_bad:
                raise BadShard(
                    f"{self.path}: shard {s['path']} {why}; run verify() for a full check, or "
                    "open the run with skip_bad=True to read the other shards"
                )
            self.bad_shards[s["path"]] = why
            log.warning("%s: shard %s %s; skipped (skip_bad)", self.path, s["path"], why)

    def _shard_problem(self, entry: dict[str, Any]) -> str | None:
        """What is wrong with a listed shard, by its size and framing; None: whole."""
        p = self.path / entry["path"]
        try:
            layout.inside(self.path, p)
            size = p.stat().st_size
            if size != entry["bytes"]:
                return f"has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
            with open(p, "rb") as f:
                head = f.read(8)
                f.seek(max(0, size - 10))
                tail = f.read(10)
        except layout.UnsafePath:
            return "is outside the run directory"
        except FileNotFoundError:
            return "is listed but missing"
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if self.ipc == "file":
            whole = head.startswith(_FILE_MAGIC) and tail.endswith(_FILE_MAGIC)
        else:
            whole = head.startswith(b"\xff\xff\xff\xff") and tail.endswith(_STREAM_END)
        return None if whole else f"is not a whole Arrow IPC {self.ipc} (its framing is broken)"

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def ipc(self) -> str:
        return self.manifest.get("ipc", "file")

    @property
    def reduction(self) -> Reduction:
        return Reduction.from_json(self.manifest.get("reduction") or {"kind": "none"})

    @property
    def width(self) -> int:
        """Columns of a decoded activation row (``k`` for ``proj:K``, else hidden)."""
        return self.reduction.decoded_width(self.hidden_size)

    def shard_entries(self, layer: int | None = None, hook: str | None = None) -> list[dict]:
        """The manifest's entries of the shards read (those of ``bad_shards`` left out)."""
        return [
            s
            for s in self.manifest["shards"]
            if (layer is None or s["layer"] == layer)
            and (hook is None or s["hook"] == hook)
            and s["path"] not in self.bad_shards
        ]

    def shards(self, layer: int | None = None, hook: str | None = None) -> list[Path]:
        return [self.path / s["path"] for s in self.shard_entries(layer, hook)]

    def read(self, shard: Path) -> pa.Table:
        return layout.read_shard(shard, self.ipc)

    def hook_of(self, layer: int, hook: str | None = None) -> str:
        """``hook``, or the one hook stored for ``layer`` (several: a ValueError naming
        them, so rows of two hooks are never mixed by leaving it out)."""
        if hook is not None:
            return hook
        hooks = sorted({s["hook"] for s in self.shard_entries(layer)})
        if len(hooks) > 1:
            raise ValueError(
                f"{self.path}: layer {layer} is stored with hooks {hooks}; name one, e.g. "
                f"hook={hooks[-1]!r}"
            )
        return hooks[0] if hooks else "post_block"

    def dataset(self, layer: int | None = None, hook: str | None = None) -> ds.Dataset:
        """The committed shards as a pyarrow dataset: all of them, or one layer's (of
        ``hook``, which may be left out when the layer has one hook stored), lazy for
        ``--ipc file`` runs, memory-mapped tables for ``stream`` runs."""
        if layer is not None:
            hook = self.hook_of(layer, hook)
        return self._dataset(layer, hook)

    def _dataset(self, layer: int | None, hook: str | None) -> ds.Dataset:
        """The shards of ``layer`` and ``hook`` (None: any) as a pyarrow dataset."""
        paths = self.shards(layer, hook)
        if not paths:  # else an empty dataset, and a filter fails with "No match for FieldRef"
            raise FileNotFoundError(
                f"{self.path}: no committed shards for layer {layer} hook {hook!r}; the run "
                f"has streams {sorted(self.manifest.get('rows', {}))}"
            )
        if self.ipc == "file":
            return ds.dataset([str(p) for p in paths], format="ipc")
        return ds.dataset([self.read(p) for p in paths])

    def decode(self, table: pa.Table | pa.RecordBatch) -> torch.Tensor:
        """The activation rows of ``table`` decoded from the run's reduction.

        PCA rows of several layers/hooks are decoded each with its own basis (found
        by their ``layer`` and ``hook`` columns)."""
        taps = None
        if self.reduction.kind == "pca" and {"layer", "hook"} <= set(table.schema.names):
            taps = pa.table({"layer": table.column("layer"), "hook": table.column("hook")})
            taps = taps.group_by(["layer", "hook"]).aggregate([]).to_pylist()
        if not taps or len(taps) == 1:
            return self.decoder.decode(table, self.hidden_size)
        out = torch.empty(table.num_rows, self.width)
        for tap in taps:
            mask = pc.and_(
                pc.equal(table.column("layer"), tap["layer"]),
                pc.equal(table.column("hook"), tap["hook"]),
            )
            rows = torch.from_numpy(np.flatnonzero(mask.to_numpy(zero_copy_only=False)))
            basis = self.manifest["bases"][point_key(tap["layer"], tap["hook"])]["path"]
            out[rows] = self.decoder.decode(table.filter(mask), self.hidden_size, basis)
        return out

    def request_rows(
        self,
        request_id: str,
        layer: int,
        hook: str | None = None,
        sample_index: int | None = None,
    ) -> tuple[np.ndarray, torch.Tensor]:
        """``(positions, activations)`` of one request (of one ``n > 1`` child when
        ``sample_index`` is given) at ``layer`` and ``hook`` (as ``dataset``: may be
        left out when the layer has one hook stored), sorted by position. A request
        with no rows there raises ``KeyError``.

        Positions are returned as stored, so callers can check for gaps or repeats.
        """
        hook = self.hook_of(layer, hook)
        cols = ["position", *self._activation_columns(hook)]
        flt = pc.field("request_id") == request_id
        if sample_index is not None:
            flt &= pc.field("sample_index") == sample_index
        table = self.dataset(layer, hook).to_table(columns=cols, filter=flt)
        if table.num_rows == 0:
            child = "" if sample_index is None else f", sample {sample_index}"
            raise KeyError(
                f"{self.path}: request {request_id!r}{child} has no rows at layer {layer} hook "
                f"{hook!r}; request_ids({layer}) lists those stored there"
            )
        table = table.sort_by("position")
        return table.column("position").to_numpy(), self.decode(table)

    def request(self, request_id: str, layer: int, hook: str | None = None) -> torch.Tensor:
        """One request's activations at ``layer``: ``[n_tokens, width]`` by position
        (``hook`` and errors as ``request_rows``)."""
        return self.request_rows(request_id, layer, hook)[1]

    def request_ids(self, layer: int | None = None, hook: str | None = None) -> list[str]:
        """The request ids stored (at ``layer``, at any of its hooks unless ``hook``)."""
        table = self._dataset(layer, hook).to_table(columns=["request_id"])
        return sorted(pc.unique(table.column("request_id")).to_pylist())

    def router_rows(
        self, request_id: str, layer: int, sample_index: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(positions, expert ids, weights)`` of one request's ``router`` rows at
        ``layer``, by position: ids int64 ``[n, top_k]``, weights float32 ``[n, top_k]``
        (the stored row is ``[ids, weights]`` in float32, as the bus carries it). Ids
        that are not integers in ``[0, num_experts)`` (the run's manifest says how
        many) raise ``ValueError``: the file is not what a router wrote."""
        pos, rows = self.request_rows(request_id, layer, ROUTER_HOOK, sample_index)
        ids, weights = split_router_rows(rows.numpy(), self.manifest.get("router"))
        return pos, ids, weights

    def _activation_columns(self, hook: str | None = None) -> list[str]:
        if hook == ROUTER_HOOK:  # stored as captured whatever the reduction
            return ["activation"]
        kind = self.reduction.kind
        return (
            ["activation"]
            + (["scale"] if kind == "int8" else [])
            + (["topk_index"] if kind == "topk" else [])
        )

    def verify(self) -> list[str]:
        """Problems found: listed shards missing, of the wrong size or checksum, or
        unreadable; shard files on disk the manifest does not list. Empty: all good."""
        problems = []
        listed = set()
        for s in self.manifest["shards"]:
            p = self.path / s["path"]
            listed.add(p)
            if not p.exists():
                problems.append(f"{s['path']}: listed but missing")
                continue
            if p.stat().st_size != s["bytes"]:
                problems.append(f"{s['path']}: {p.stat().st_size} bytes, manifest {s['bytes']}")
            elif layout.checksum(p) != s["checksum"]:
                problems.append(f"{s['path']}: checksum differs from the manifest")
            elif self.read(p).num_rows != s["rows"]:
                problems.append(f"{s['path']}: row count differs from the manifest")
        for p, _ in layout.shard_files(self.path):
            if p not in listed:
                problems.append(f"{p.relative_to(self.path)}: on disk, not in the manifest")
        return problems


def split_router_rows(
    rows: np.ndarray, router: dict[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Stored ``router`` rows ``[n, 2 * top_k]`` as ``(ids int64, weights float32)``,
    each ``[n, top_k]``; ``router``: the manifest's ``{num_experts, top_k}``, which
    the ids and the width are checked against (without it, ids are checked to be
    integers >= 0)."""
    rows = np.asarray(rows, dtype=np.float32)
    info = router_info({"router": router}) if router is not None else None
    if rows.ndim != 2 or rows.shape[1] % 2 or (info and rows.shape[1] != 2 * info[1]):
        want = f"2 * top_k = {2 * info[1]}" if info else "an even width [ids, weights]"
        raise ValueError(f"router rows of shape {list(rows.shape)}: expected {want}")
    k = rows.shape[1] // 2
    ids = rows[:, :k]
    top = info[0] if info else np.inf
    if not (np.isfinite(ids).all() and (ids == np.floor(ids)).all()):
        raise ValueError("router rows: an expert id is not an integer")
    if len(ids) and (ids.min() < 0 or ids.max() >= top):
        raise ValueError(
            f"router rows: expert ids span [{ids.min():g}, {ids.max():g}], outside "
            f"[0, num_experts={top})"
        )
    return ids.astype(np.int64), np.ascontiguousarray(rows[:, k:])
