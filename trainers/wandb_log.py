"""W&B for the trainers: the logger they use, and reading an offline run back.

Runs log through Lightning's ``WandbLogger``; without W&B credentials (or with
``WANDB_MODE=offline``) the run is written under ``save_dir/wandb/offline-run-*``
and can be uploaded later with ``wandb sync``. wandb 0.31 ships no Python reader
for its ``.wandb`` files, so ``read_history`` parses them here: the file is a
LevelDB-style log (7-byte file header, 32 KiB blocks, records with a 7-byte header
whose payloads are ``wandb_internal_pb2.Record`` protobufs).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

_FILE_HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version
_REC_HEADER = struct.Struct("<IHB")  # crc32c, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def make_logger(project: str, name: str, save_dir: str | Path, config: dict[str, Any]):
    """A ``WandbLogger``: online where the user has W&B set up, offline otherwise."""
    from lightning.pytorch.loggers import WandbLogger

    offline = os.environ.get("WANDB_MODE") == "offline" or not _has_credentials()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(
        project=project, name=name, save_dir=str(save_dir), offline=offline, config=config
    )


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="replace")


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    ident, magic, _version = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path}: not a W&B run file (header {ident!r}, magic {magic:#x})")
    out: list[bytes] = []
    part = b""
    off = _FILE_HEADER.size
    while off + _REC_HEADER.size <= len(data):
        left_in_block = _BLOCK - off % _BLOCK
        if left_in_block < _REC_HEADER.size:  # block trailer padding
            off += left_in_block
            continue
        _crc, length, kind = _REC_HEADER.unpack_from(data, off)
        off += _REC_HEADER.size
        if kind == 0 and length == 0:  # zero padding at the end of a block
            off += left_in_block - _REC_HEADER.size
            continue
        payload = data[off : off + length]
        off += length
        if kind == _FULL:
            out.append(payload)
        elif kind == _FIRST:
            part = payload
        elif kind == _MIDDLE:
            part += payload
        elif kind == _LAST:
            out.append(part + payload)
            part = b""
    return out


def run_files(save_dir: str | Path) -> list[Path]:
    """The ``.wandb`` files of the runs under ``save_dir`` (offline or synced)."""
    return sorted(Path(save_dir).glob("wandb/*run-*/run-*.wandb"))


def read_history(run_file: str | Path) -> list[dict[str, Any]]:
    """Every ``history`` row (one per logged step) of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in _records(Path(run_file)):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        rows.append(
            {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                for item in rec.history.item
            }
        )
    return rows
