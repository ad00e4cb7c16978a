"""On-disk layout of an activation run, shared by the sink and the reader.

    RUN/manifest.json
    RUN/layer-03/post_block/shard-000000.arrow

Shards are Arrow IPC files, one row per captured token. The activation column is
an Arrow ``fixed_shape_tensor`` of shape ``[hidden]``; bfloat16, which Arrow has
no type for, is stored as uint16 bit patterns with ``actbus.dtype`` in the field
metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1

_STORAGE = {"float32": pa.float32(), "float16": pa.float16(), "bfloat16": pa.uint16()}


def shard_dir(run: Path, layer: int, hook: str) -> Path:
    return run / f"layer-{layer:02d}" / hook


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.arrow"


def schema(dtype: str, hidden: int) -> pa.Schema:
    tensor_type = pa.fixed_shape_tensor(_STORAGE[dtype], [hidden])
    return pa.schema(
        [
            pa.field("request_id", pa.string()),
            pa.field("position", pa.int64()),
            pa.field("token_id", pa.int64()),
            pa.field("step", pa.int64()),
            pa.field("layer", pa.int32()),
            pa.field("hook", pa.string()),
            pa.field("activation", tensor_type, metadata={"actbus.dtype": dtype}),
        ],
        metadata={"actbus.format": str(FORMAT_VERSION)},
    )


def tensor_to_arrow(t: torch.Tensor) -> pa.ExtensionArray:
    """[rows, hidden] tensor to a fixed_shape_tensor array (bf16 as uint16 bits)."""
    t = t.detach().cpu().contiguous()
    arr = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(arr))


def arrow_to_tensor(col: pa.ChunkedArray | pa.Array, dtype: str) -> torch.Tensor:
    """A fixed_shape_tensor column back to a [rows, hidden] tensor of ``dtype``."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    arr = col.to_numpy_ndarray()
    t = torch.from_numpy(np.require(arr, requirements=["C", "W"]))  # copies if read-only
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def read_manifest(run: Path) -> dict[str, Any] | None:
    p = run / MANIFEST
    if not p.exists():
        return None
    return json.loads(p.read_text())


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
