"""Spill: one subscriber's overflow kept on the publisher's local disk.

Messages a ``spill`` subscriber has no credit for are appended, exactly as they go
on the wire (header and tensor bytes), to segment files in a directory of their
own; an in-memory index (seq, offsets, sizes) replays them oldest first once the
subscriber grants credit again. A segment file is deleted as soon as its last
record is replayed or evicted, and the whole directory when the subscriber leaves,
so disk use follows the backlog. Nothing is fsynced: the spill is a buffer for a
live stream, not a durable log (it dies with the publisher, as the stream does).

Each record on disk is ``seq u64 | header_len u32 | payload_len u64 | header |
payload`` (little-endian), so a segment is readable on its own when debugging.

A publisher killed (kill -9) deletes nothing: its spill directory (``SpillRoot``,
named ``actbus-spill-*``) holds a lock file its publisher keeps locked while it lives,
so the next publisher to start with the same parent directory finds it unlocked and
deletes it (``sweep``); a live publisher's is locked, and never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

_PREFIX = struct.Struct("<QIQ")
ROOT_PREFIX = "actbus-spill-"
_NEW_PREFIX = ".actbus-spill-new-"  # until its lock is held: never swept
LOCK_FILE = "owner.lock"
log = logging.getLogger("actbus.publisher")


class SpillRoot:
    """One publisher's spill directory, locked for as long as the publisher lives."""

    def __init__(self, parent: str | Path | None) -> None:
        """Made under ``parent`` (None: the system temp dir)."""
        where = Path(parent if parent is not None else tempfile.gettempdir())
        new = Path(tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=where))
        fd = os.open(new / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Named for ``sweep`` only once locked: it never sees one it could take as dead.
        self.path = where / (ROOT_PREFIX + new.name.removeprefix(_NEW_PREFIX))
        os.rename(new, self.path)
        self._lock = fd

    def close(self) -> None:
        """Delete it (every subscriber's spill in it), then let go of the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)


def sweep(parent: Path) -> int:
    """Delete the spill directories under ``parent`` whose publisher is gone; how many.

    Only this user's ``actbus-spill-*`` directories with a lock file are judged: one
    whose lock can be taken has no live owner (the kernel lets go of a killed
    process's locks). One that is locked, or has no lock file, is left alone."""
    swept = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for e in entries:
        if not e.name.startswith(ROOT_PREFIX):
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat().st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(e.path, LOCK_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its publisher lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(e.path, ignore_errors=True)
            swept += 1
        finally:
            os.close(fd)
    if swept:
        log.info("actbus: deleted %d spill directories killed publishers left in %s", swept, parent)
    return swept


@dataclass(frozen=True)
class SpillRecord:
    """Where one spilled message lives."""

    seq: int
    step: int
    segment: int
    offset: int
    header_len: int
    payload_len: int

    @property
    def nbytes(self) -> int:
        """Bytes it holds against the cap (what it would put on the wire)."""
        return self.header_len + self.payload_len


class SpillLog:
    """Append-only segment files of one subscriber's backlog, read back in order."""

    def __init__(self, directory: Path, segment_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._index: deque[SpillRecord] = deque()
        self._live: dict[int, int] = {}  # segment -> records not yet consumed
        self._fds: dict[int, int] = {}  # segment -> fd (read and write)
        self._write_seg = -1
        self._write_pos = 0
        self._next_seg = 0
        self.nbytes = 0  # held against the cap
        self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self._index)

    def __bool__(self) -> bool:
        return bool(self._index)

    def head(self) -> SpillRecord:
        return self._index[0]

    def append(self, seq: int, step: int, header: bytes, payload: memoryview | bytes) -> None:
        if self._write_seg < 0 or self._write_pos >= self.segment_bytes:
            self._write_seg = self._next_seg
            self._next_seg += 1
            self._write_pos = 0
            self._live[self._write_seg] = 0
            self._fds[self._write_seg] = os.open(
                self._path(self._write_seg), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600
            )
        fd = self._fds[self._write_seg]
        prefix = _PREFIX.pack(seq, len(header), len(payload))
        parts = [prefix, header, payload]
        total = sum(len(p) for p in parts)
        written = 0
        while written < total:  # writev may be partial for large payloads
            n = os.pwritev(fd, _skip(parts, written), self._write_pos + written)
            if n <= 0:
                raise OSError(f"spill write to {self._path(self._write_seg)} made no progress")
            written += n
        rec = SpillRecord(
            seq, step, self._write_seg, self._write_pos + _PREFIX.size, len(header), len(payload)
        )
        self._write_pos += total
        self._index.append(rec)
        self._live[rec.segment] += 1
        self.nbytes += rec.nbytes
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def read_head(self) -> tuple[bytes, memoryview]:
        """The oldest record's header and payload bytes (it stays until ``discard``)."""
        rec = self._index[0]
        data = os.pread(self._fds[rec.segment], rec.nbytes, rec.offset)
        if len(data) != rec.nbytes:
            raise OSError(f"spill segment {self._path(rec.segment)} is truncated")
        view = memoryview(data)
        return view[: rec.header_len].tobytes(), view[rec.header_len :]

    def discard(self) -> SpillRecord:
        """Remove the oldest record (replayed, or evicted unread)."""
        rec = self._index[0]
        self._consume()
        return rec

    def close(self) -> None:
        """Delete every segment and the directory."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._index.clear()
        self._live.clear()
        self.nbytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)

    def _consume(self) -> None:
        rec = self._index.popleft()
        self.nbytes -= rec.nbytes
        self._live[rec.segment] -= 1
        if self._live[rec.segment] == 0:  # the write segment too: the next append opens one
            self._drop_segment(rec.segment)

    def _drop_segment(self, seg: int) -> None:
        os.close(self._fds.pop(seg))
        del self._live[seg]
        os.unlink(self._path(seg))
        if seg == self._write_seg:
            self._write_seg = -1

    def _path(self, seg: int) -> Path:
        return self.directory / f"seg-{seg:08d}.spill"


def _skip(parts: list[bytes | memoryview], n: int) -> list[memoryview]:
    """``parts`` without their first ``n`` bytes (to resume a partial writev)."""
    out: list[memoryview] = []
    for p in parts:
        m = memoryview(p).cast("B")
        if n >= len(m):
            n -= len(m)
            continue
        out.append(m[n:])
        n = 0
    return out
