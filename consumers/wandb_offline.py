"""Read a W&B run's transaction log (``run-ID.wandb``) back, e.g. an offline run.

W&B writes every record of a run to this file, as protobuf ``Record`` messages in
a LevelDB-style log (32 KiB blocks, each chunk with a CRC32 of its type byte and
data). wandb 0.31 ships no Python reader of it, so this is one: small, checked
(a bad CRC or a truncated chunk raises, naming the offset), used by the tests to
check what the W&B consumer logged without a W&B server.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_IDENT, _MAGIC, _VERSION = b":W&B", 0xBEE1, 0
_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")  # crc32, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def has_credentials() -> bool:
    """Whether W&B can log in: an API key in the environment or a .netrc entry."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="replace")


def offline_mode() -> bool:
    """Whether a run here logs offline: asked for (``WANDB_MODE=offline``), or no
    credentials to log in with (then W&B would stop on a login error)."""
    return os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not has_credentials()


class CorruptLog(ValueError):
    """The file is not a W&B transaction log, or a chunk fails its checksum."""


def records(path: str | Path) -> Iterator[pb.Record]:
    """Every record of the log, in order."""
    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER.size:
        raise CorruptLog(f"{path}: too short for a W&B log header")
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (_IDENT, _MAGIC, _VERSION):
        raise CorruptLog(f"{path}: not a W&B log (header {ident!r} {magic:#x} v{version})")
    off, pending = _FILE_HEADER.size, b""
    while off < len(data):
        left = _BLOCK - off % _BLOCK
        if left < _CHUNK.size:  # block trailer: zero padding
            off += left
            continue
        if off + _CHUNK.size > len(data):
            raise CorruptLog(f"{path}: truncated chunk header at offset {off}")
        crc, length, kind = _CHUNK.unpack_from(data, off)
        if crc == 0 and length == 0 and kind == 0:  # padding to the end of the block
            off += left
            continue
        body = data[off + _CHUNK.size : off + _CHUNK.size + length]
        if len(body) != length:
            raise CorruptLog(f"{path}: truncated chunk at offset {off}")
        if zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise CorruptLog(f"{path}: checksum mismatch at offset {off}")
        off += _CHUNK.size + length
        if kind == _FULL:
            yield _parse(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            yield _parse(pending + body)
            pending = b""
        else:
            raise CorruptLog(f"{path}: unknown chunk type {kind} at offset {off}")


def _parse(body: bytes) -> pb.Record:
    r = pb.Record()
    r.ParseFromString(body)
    return r


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged rows, values decoded from JSON (histograms as ``key/values`` etc.)."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({_item_key(i): json.loads(i.value_json) for i in r.history.item})
    return rows


def run_info(path: str | Path) -> dict[str, Any]:
    """Project, group, job type and config of the run."""
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
            return {
                "project": r.run.project,
                "group": r.run.run_group,
                "job_type": r.run.job_type,
                "run_id": r.run.run_id,
                "config": config,
            }
    raise CorruptLog(f"{path}: no run record")


def find_runs(wandb_dir: str | Path) -> list[Path]:
    """The transaction logs under a W&B directory (``wandb/*run-*/run-*.wandb``)."""
    return sorted(Path(wandb_dir).rglob("run-*.wandb"))
