"""Shared memory: the data plane for subscribers on the publisher's host.

A publisher with subscribers on its own host keeps one ``Region``: a sealed memfd
(``os.memfd_create``), mode 0600, that never has a name in ``/dev/shm``, so no crash
of anyone can leave one behind; the kernel frees it when the last process that maps
it goes. The engine's device-to-host copies land in it (pinned with
``cudaHostRegister`` on CUDA, so they stay asynchronous); what arrives otherwise
(CPU tensors, a filter's cut) is copied in once, on the publisher thread. Every local
subscriber then gets a descriptor (offset and length) on its socket instead of the
bytes, and reads the one copy through its own read-only mapping (``Mapping``): one
copy of each message serves every local subscriber.

A block of the region is free again when nothing refers to it: each block is a numpy
array of its own, and every tensor, frame and view made from it keeps it alive, so
its ``weakref.finalize`` runs exactly when the last one goes. The publisher holds a
block for each local subscriber until that subscriber acknowledges the message
(credit), so a subscriber holds at most its window of the region. Blocks are placed
first fit, lowest address first, and a freed block is reused at once whatever is held
around it: a subscriber that keeps one view holds that block, not the region.

The seals make the safety promises hold against peers of the same user too:
``F_SEAL_SHRINK``/``F_SEAL_GROW`` stop anyone from resizing the region (a shrunk
region would kill whoever reads past its end with SIGBUS, the engine included), and
``F_SEAL_FUTURE_WRITE`` (Linux 5.1) stops anyone from writing it or mapping it
writable again: only the publisher's own mapping, made before the seal, writes. A
subscriber maps it only when it is sealed against shrinking (``Mapping.attach``): a
publisher is a peer too.

Subscribers find the region through ``/proc/PID/fd/FD`` of the publisher's process
(same user, same host, same pid namespace: what ``host_facts`` lets both sides
compare in HELLO), and check that what they opened is that region: its inode, size,
owner, mode, seals and a random token written at its start.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from actbus.wire import DTYPES, Header, WireError

log = logging.getLogger("actbus.publisher")

DEFAULT_SHM_MB = 1024.0
"""The region's size by default: a few steps of many taps (``actbus.shm_mb``)."""
MAX_SHM_BYTES = 1 << 44
HEADER_BYTES = 4096
"""The region's first page: the token subscribers check, never handed out."""
TOKEN_BYTES = 32
ALIGN = 256
RESERVE_STEP = 16 << 20
"""Memory is reserved for the region this much at a time, as its ring first reaches
it: a write to a page tmpfs could not back would be a SIGBUS, so a full /dev/shm
makes a block not fit (the socket is used) instead."""
DESCRIPTOR = struct.Struct("<QQ")
"""A region message's last frame: offset and length of its rows in the region."""
F_SEAL_FUTURE_WRITE = 0x0010  # not in Python's fcntl; Linux >= 5.1
MADV_POPULATE_WRITE = 23  # not in Python 3.11's mmap; Linux >= 5.14
_SEALS_NEEDED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_ENV = "ACTBUS_SHM"


class ShmError(OSError):
    """A region could not be made or mapped; the socket path is used instead."""


def wanted_by_default() -> bool:
    """Whether subscribers ask for the shared-memory path (``ACTBUS_SHM=0``: never)."""
    return os.environ.get(_ENV, "1") not in ("0", "false", "no", "off")


_FACTS: dict[str, Any] | None = None


def host_facts() -> dict[str, Any]:
    """What must be equal on both sides for a subscriber to map a publisher's region:
    the same boot of the same machine, the same user, the same pid namespace."""
    global _FACTS
    if _FACTS is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            boot, pidns = "", 0
        _FACTS = {"boot": boot, "uid": os.getuid(), "pidns": pidns}
    return dict(_FACTS)


def same_host(facts: Any) -> bool:
    """A HELLO's ``shm`` field says the subscriber can map this process's regions."""
    mine = host_facts()
    return (
        isinstance(facts, dict)
        and bool(mine["boot"])
        and all(facts.get(k) == v and type(facts.get(k)) is type(v) for k, v in mine.items())
    )


class Region:
    """The publisher's shared memory: blocks handed out as tensors, freed when unused."""

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        size = HEADER_BYTES + -(-int(nbytes) // ALIGN) * ALIGN
        try:
            fd = os.memfd_create("actbus-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as e:
            raise ShmError(f"cannot make a shared-memory region: {e}") from e
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            # The first step's room reserved now (a full tmpfs fails here); the rest as
            # the ring first reaches it (``_reserve``), so an idle region costs little.
            os.posix_fallocate(fd, 0, min(size, RESERVE_STEP))
            self._map = mmap.mmap(fd, size)
            self._populate(0, min(size, RESERVE_STEP))
            seals = _SEALS_NEEDED | F_SEAL_FUTURE_WRITE
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
                self.write_sealed = True
            except OSError:  # a kernel before 5.1: no one can resize it, at least
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS_NEEDED)
                self.write_sealed = False
        except OSError as e:
            os.close(fd)
            raise ShmError(
                f"cannot make a {size >> 20} MiB shared-memory region ({e}); lower "
                "actbus.shm_mb, or give /dev/shm more room"
            ) from e
        self.fd = fd
        self.size = size
        self._reserved = min(size, RESERVE_STEP)  # bytes backed by memory so far
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = self.token
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self.base = int(self._buf.ctypes.data)
        self._ino = os.fstat(fd).st_ino
        self._lock = threading.Lock()
        self._holes: list[list[int]] = [[HEADER_BYTES, size]]  # free [start, end), by start
        self.used = 0  # bytes in blocks not yet freed
        self.peak = 0
        self.blocks = 0  # handed out, ever
        self.full = 0  # times a block did not fit
        self.pinned = False
        self._closed = False
        if pin:
            self._pin()

    def _pin(self) -> None:
        """Page-lock the region for CUDA, so device copies into it stay asynchronous."""
        try:
            err = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0)
        except Exception as e:  # CUDA present but unusable: copies are synchronous
            log.warning("actbus: could not pin the shared-memory region (%s)", e)
            return
        code = int(getattr(err, "value", err))
        if code == 0:
            self.pinned = True
        else:
            log.warning("actbus: cudaHostRegister of the shared-memory region failed (%d)", code)

    def offer(self) -> dict[str, Any]:
        """What a subscriber needs to map it (a WELCOME's ``shm``)."""
        return {
            "pid": os.getpid(),
            "fd": self.fd,
            "size": self.size,
            "ino": self._ino,
            "token": self.token,
        }

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A fresh uint8 block of ``nbytes``, or None if it does not fit now. Any thread."""
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            start = None if self._closed else self._place(n)
            if start is None:
                self.full += 1
                return None
            block = (start, start + n)
            self.used += n
            self.peak = max(self.peak, self.used)
            self.blocks += 1
        arr = self._buf[start : start + nbytes]
        weakref.finalize(arr, self._free, block)
        return torch.from_numpy(arr)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A fresh tensor in the region (the engine's host copies land here), or None."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block = self.alloc(nbytes)
        if block is None:
            return None
        return block.view(dtype).view(shape)

    def stage(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` copied into the region (None: no room now)."""
        block = self.alloc(t.numel() * t.element_size())
        if block is None:
            return None
        out = block.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def offset(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes lie in the region (None: not in it)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        off = t.data_ptr() - self.base
        if off >= HEADER_BYTES and off + t.numel() * t.element_size() <= self.size:
            return off
        return None

    def _place(self, n: int) -> int | None:
        """The lowest hole ``n`` fits in, taken (None: none, or no memory to back it).
        Lowest first keeps the region's footprint the size of what is in flight."""
        for i, hole in enumerate(self._holes):
            start, end = hole
            if end - start >= n:
                if not self._reserve(start + n):
                    return None
                if end - start == n:
                    del self._holes[i]
                else:
                    hole[0] = start + n
                return start
        return None

    def _reserve(self, end: int) -> bool:
        """Back the region with memory up to ``end`` (False: tmpfs is full)."""
        if end <= self._reserved:
            return True
        grow = min(self.size, max(end, self._reserved + RESERVE_STEP)) - self._reserved
        try:
            os.posix_fallocate(self.fd, self._reserved, grow)
        except OSError as e:
            log.warning("actbus: the shared-memory region cannot grow (%s)", e)
            return False
        self._populate(self._reserved, grow)
        self._reserved += grow
        return True

    def _populate(self, start: int, length: int) -> None:
        """Map the pages in now, in one call, rather than one fault per page at the
        engine's first copy into each (Linux 5.14+; elsewhere the faults stay)."""
        with contextlib.suppress(OSError, ValueError):
            self._map.madvise(MADV_POPULATE_WRITE, start, length)

    def _free(self, block: tuple[int, int]) -> None:
        start, end = block
        with self._lock:
            self.used -= end - start
            holes = self._holes
            i = bisect.bisect_left(holes, [start])
            if i < len(holes) and holes[i][0] == end:  # joins the hole after it
                holes[i][0] = start
            else:
                holes.insert(i, [start, end])
            if i > 0 and holes[i - 1][1] == start:  # and the one before
                holes[i - 1][1] = holes[i][1]
                del holes[i]

    def stats(self) -> dict[str, Any]:
        return {
            "bytes": self.size,
            "reserved_bytes": self._reserved,
            "used_bytes": self.used,
            "peak_bytes": self.peak,
            "blocks": self.blocks,
            "full": self.full,
            "pinned": self.pinned,
            "write_sealed": self.write_sealed,
        }

    def close(self) -> None:
        """Unpin and let go of the descriptor; the memory goes with the last block and
        the last subscriber's mapping."""
        if self.pinned:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        with self._lock:  # no allocation reserves through a closed descriptor
            self._closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)


class Mapping:
    """A subscriber's read-only view of a publisher's region."""

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self._map = mm
        self._view = memoryview(mm)
        self.size = size

    @classmethod
    def attach(cls, offer: Any) -> Mapping:
        """Map the region a WELCOME offers, after checking it is what it says (ShmError)."""
        if not isinstance(offer, dict):
            raise ShmError("the WELCOME's shm offer is not a map")
        pid, fd, size, ino, token = (offer.get(k) for k in ("pid", "fd", "size", "ino", "token"))
        for name, v, hi in (("pid", pid, 1 << 31), ("fd", fd, 1 << 31), ("ino", ino, 1 << 64)):
            if type(v) is not int or not 0 <= v < hi:
                raise ShmError(f"the shm offer's {name} is not an int in range: {v!r:.40}")
        if type(size) is not int or not HEADER_BYTES < size <= MAX_SHM_BYTES:
            raise ShmError(f"the shm offer's size is out of range: {size!r:.40}")
        if type(token) is not bytes or len(token) != TOKEN_BYTES:
            raise ShmError("the shm offer's token is not 32 bytes")
        try:
            rfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ShmError(f"cannot open the publisher's region ({e})") from e
        try:
            st = os.fstat(rfd)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != ino or st.st_size != size:
                raise ShmError("the file offered is not the region the publisher named")
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ShmError("the region is not private to this user (mode 0600)")
            seals = fcntl.fcntl(rfd, fcntl.F_GET_SEALS)
            if seals & _SEALS_NEEDED != _SEALS_NEEDED:
                raise ShmError("the region is not sealed against resizing; not mapped")
            mm = mmap.mmap(rfd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as e:
            if isinstance(e, ShmError):
                raise
            raise ShmError(f"cannot map the publisher's region ({e})") from e
        finally:
            os.close(rfd)
        if mm[:TOKEN_BYTES] != token:
            mm.close()
            raise ShmError("the region's token differs from the offer's")
        return cls(mm, size)

    def tensor(self, descriptor: memoryview | bytes, header: Header) -> tuple[torch.Tensor, Any]:
        """The rows a descriptor names, zero-copy, and the object whose life is the
        view's (its finalizer says the subscriber no longer reads them). Every field
        checked against the region's bounds and the header (``WireError``)."""
        if len(descriptor) != DESCRIPTOR.size:
            raise WireError(f"region descriptor must be {DESCRIPTOR.size} bytes", "descriptor")
        off, n = DESCRIPTOR.unpack(descriptor)
        if n != header.nbytes:
            raise WireError(
                f"region descriptor names {n} bytes, header says {header.nbytes}", "shape"
            )
        if not (off >= HEADER_BYTES and off + n <= self.size):
            raise WireError(
                f"region descriptor [{off}, {off + n}) lies outside the region "
                f"[{HEADER_BYTES}, {self.size})",
                "descriptor",
            )
        view = self._view[off : off + n]
        shape = tuple(header.shape)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        # A tensor of its own over the view's storage, not a view of another tensor
        # (which would keep its base, and so the region, alive past a copy-out).
        storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
        tensor = torch.empty(0, dtype=DTYPES[header.dtype]).set_(storage, 0, shape, strides)
        return tensor, view


# The region is mapped read-only, and torch warns about that on every message:
# silenced once, for this module's calls only (as ``wire`` does for socket frames).
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)
