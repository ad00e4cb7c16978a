"""On-disk layout of an activation run, shared by the sink, the readers and replay.

    RUN/manifest.json
    RUN/L3.post_block/shard-000000.arrow
    RUN/reductions/L3.post_block.safetensors   (a PCA basis, when used)

A stream's directory is named by ``actbus.streams.point_key``, as everywhere a user
sees a (layer, hook). Runs written before that name (``RUN/layer-03/post_block``,
``RUN/reductions/layer-03-post_block.safetensors``) keep loading: readers follow the
manifest's paths, a sink appending to such a run keeps its directories, and the
manifest's ``rows`` and ``bases`` keys are read in either spelling.

Shards are Arrow IPC files, one row per captured token. The activation column is
a ``fixed_size_list`` of ``[width]`` values (not the ``fixed_shape_tensor``
extension type: Hugging Face ``datasets`` 5.2 has no feature for it and refuses
the file, while a fixed-size list loads as ``List(Value(...), length=width)``).
bfloat16, which Arrow has no type for, is stored as uint16 bit patterns; the
stored dtype and reduction are in the field and schema metadata, so every shard
decodes on its own.

Two IPC framings, chosen per run (``--ipc``): ``file`` (default; the random-access
format ``pyarrow.dataset``, Polars, DuckDB and ``load_dataset("arrow")`` read) or
``stream`` (what ``datasets.Dataset.from_file`` memory-maps; ``pyarrow.dataset``
cannot open it, so ``ActivationRun.dataset`` then builds an in-memory dataset
over memory-mapped tables).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actbus.logcap import capped
from actbus.streams import parse_point_key, point_key

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
IPC_FORMATS = ("file", "stream")
COMPRESSIONS = ("none", "zstd", "lz4")

STORAGE = {
    "float32": pa.float32(),
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "int8": pa.int8(),
    "uint16": pa.uint16(),
    "int32": pa.int32(),
}
TORCH = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int32": torch.int32,
}

# Row metadata columns, in order, before the reduction's own columns.
META_FIELDS = [
    pa.field("request_id", pa.string()),
    pa.field("sample_index", pa.int32()),
    pa.field("position", pa.int64()),
    pa.field("token_id", pa.int64()),
    pa.field("step", pa.int64()),
    pa.field("layer", pa.int32()),
    pa.field("hook", pa.string()),
    pa.field("tags", pa.string()),  # the request's tags as a JSON object ("{}": none)
]


_HOOK = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""What a hook may look like to become a directory name (the wire also checks that
it is a known hook; this holds whatever the caller passes)."""


class UnsafePath(ValueError):
    """Rows whose layer or hook would make a path outside the run directory."""


SHARD_GLOBS = ("L*.*/shard-*.arrow", "layer-*/*/shard-*.arrow")
"""Where shard files lie: ``RUN/L3.post_block/``, in older runs ``RUN/layer-03/post_block/``."""


def shard_dir(run: Path, layer: int, hook: str) -> Path:
    """``RUN/L3.post_block`` (``RUN/layer-03/post_block`` where an older run has it, so
    appending to it keeps one directory per stream): refused (``UnsafePath``) unless the
    layer is an int >= 0, the hook a plain name, and the directory, with symlinks
    resolved, inside ``run``."""
    check_tap(run, layer, hook)
    old = run / f"layer-{layer:02d}" / hook
    return inside(run, old if old.is_dir() else run / point_key(layer, hook))


def basis_path(run: Path, layer: int, hook: str) -> Path:
    """Where a tap's PCA basis is stored (checked as ``shard_dir`` is)."""
    check_tap(run, layer, hook)
    return inside(run, run / "reductions" / f"{point_key(layer, hook)}.safetensors")


def shard_files(run: Path, suffix: str = "") -> list[tuple[Path, tuple[int, str]]]:
    """Shard files on disk (``suffix``: ``.tmp`` for half-written ones), sorted, each
    with the (layer, hook) its directory names; other files are not the sink's."""
    found = []
    for pattern in SHARD_GLOBS:
        for p in run.glob(pattern + suffix):
            try:
                found.append((p, parse_point_key(p.parent.relative_to(run).as_posix())))
            except ValueError:
                continue
    return sorted(found)


def normalise_keys(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its ``rows`` and ``bases`` keyed by ``point_key`` (an older
    run's ``3/post_block`` keys read as ``L3.post_block``)."""
    for field in ("rows", "bases"):
        if isinstance(manifest.get(field), dict):
            manifest[field] = {
                point_key(*parse_point_key(k)): v for k, v in manifest[field].items()
            }
    return manifest


def check_tap(run: Path, layer: object, hook: object) -> None:
    if type(layer) is not int or not 0 <= layer < 1 << 31:
        raise UnsafePath(f"--out {run}: layer {capped(layer)} is not an int in [0, 2**31)")
    if type(hook) is not str or not _HOOK.fullmatch(hook):
        raise UnsafePath(
            f"--out {run}: hook {capped(hook)} is not a plain name ([a-z][a-z0-9_]*, at "
            "most 64 characters)"
        )


def inside(run: Path, path: Path) -> Path:
    """``path`` if it resolves (symlinks followed) to somewhere strictly below ``run``."""
    root = run.resolve()
    resolved = path.resolve()
    if resolved == root or not resolved.is_relative_to(root):
        raise UnsafePath(
            f"--out {run}: {capped(str(path))} resolves to {capped(str(resolved))}, outside "
            "the run directory; refused"
        )
    return path


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.arrow"


def shard_index(name: str) -> int | None:
    """The number in ``shard-NNNNNN.arrow``; None for any other name."""
    if name.startswith("shard-") and name.endswith(".arrow") and name[6:-6].isdigit():
        return int(name[6:-6])
    return None


def tag_column(key: str) -> str:
    return f"tag_{key}"


def vector_field(name: str, dtype: str, width: int, **meta: str) -> pa.Field:
    return pa.field(name, pa.list_(STORAGE[dtype], width), metadata={"actbus.dtype": dtype, **meta})


def tensor_to_arrow(t: torch.Tensor) -> pa.FixedSizeListArray:
    """[rows, width] tensor to a fixed-size list array (bf16 as uint16 bits), no copy
    of a contiguous CPU tensor."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        flat = t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    else:
        flat = t.numpy().reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), t.shape[1] if t.dim() == 2 else 1)


def arrow_to_tensor(col: pa.ChunkedArray | pa.Array, dtype: str) -> torch.Tensor:
    """A fixed-size list column back to a [rows, width] tensor of ``dtype``."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    width = col.type.list_size
    values = col.values.slice(col.offset * width, len(col) * width)
    arr = values.to_numpy(zero_copy_only=False).reshape(len(col), width)
    t = torch.from_numpy(np.require(arr, requirements=["C", "W"]))  # copies if read-only
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def read_manifest(run: Path) -> dict[str, Any] | None:
    p = run / MANIFEST
    if not p.exists():
        return None
    return normalise_keys(json.loads(p.read_text()))


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: readers see the old file or the
    new one, never half, and the rename survives a power cut."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum(path: Path) -> str:
    """``sha256:HEX`` of a file's bytes (what the manifest lists per shard)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def open_shard(
    path: Path, ipc: str = "file"
) -> pa.RecordBatchReader | pa.ipc.RecordBatchFileReader:
    """A reader over a memory-mapped shard (no copy of uncompressed buffers)."""
    source = pa.memory_map(str(path), "r")
    return pa.ipc.open_file(source) if ipc == "file" else pa.ipc.open_stream(source)


def shard_batches(path: Path, ipc: str = "file") -> Iterator[pa.RecordBatch]:
    reader = open_shard(path, ipc)
    if ipc == "file":
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def read_shard(path: Path, ipc: str = "file") -> pa.Table:
    return open_shard(path, ipc).read_all()
