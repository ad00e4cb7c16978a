"""The return path's receiver, in a process of its own (``actbus.capture.retproc``).

It subscribes exactly as the in-process ``ReturnCollector`` does (lossless, filtered
to returned requests, every publisher's welcome awaited) and writes each request's
rows into regions of shared-memory slabs (files under ``/dev/shm``), then publishes
how many rows each (request, sample, tap) has in a shared table. The front end only
registers requests, reads that table when it makes an output and maps the slabs:
receiving, crediting and copying never take the front end's GIL, so the stream drains
at bus speed however busy vLLM's output processing is.

Control messages come on stdin (length-prefixed pickles from the parent, the only
writer): ``("reg", key, reg, {tap: entry}, capacity)``, ``("release", key)``,
``("close",)``. The pipe is read without blocking before each message, and again
when a row's request is unknown: the parent registers a request before the engine
can see it, so its registration is already in the pipe. Rows of requests still
unknown after that (another front end's, or already collected) are kept, bounded in
bytes and age, for a registration that may follow.

Table entry (int64 x ``ENTRY``): ``SEQ`` (odd while a region moves), ``OWNER`` (the
registration number whose entry this is), ``SLAB``, ``BASE``, ``CAP`` (the region),
``END`` (rows written, in position order), ``ENDED`` (the request's end came on this
tap's stream), ``ROWB`` (bytes per row). A region is never reused while its request
is registered, and a slab's file is removed once no registered request has a region
there; the front end's mappings (and the views it handed out) keep the memory alive
as long as they need it. The child exits when stdin closes or its parent is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import pickle
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

log = logging.getLogger("actbus.retchild")

ENTRY = 8
SEQ, OWNER, SLAB, BASE, CAP, END, ENDED, ROWB = range(ENTRY)
HEADER = 16
"""int64 fields before the entries: ``H_PID``, ``H_RECV_NS``, ``H_CPU_NS``, ``H_MSGS``,
``H_STASH_DROPPED``, ``H_ALIVE_NS``."""
H_PID, H_RECV_NS, H_CPU_NS, H_MSGS, H_STASH_DROPPED, H_ALIVE_NS = range(6)
MAX_ENTRIES = 1 << 18
SLAB_BYTES = 256 << 20
MIN_CAPACITY = 16
STASH_BYTES = 64 << 20
"""Rows of not-yet-registered requests kept at most (bytes),"""
STASH_S = 10.0
"""and for at most this long."""


def table_bytes() -> int:
    return (HEADER + MAX_ENTRIES * ENTRY) * 8


def slab_path(prefix: str, slab: int) -> str:
    return f"{prefix}-{slab}"


def slab_arrays(mem: Any, row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A slab's rows (uint8 ``[R, row_bytes]``), positions and token ids (int64 ``[R]``)."""
    rows = len(mem) // (row_bytes + 16)
    data = np.frombuffer(mem, dtype=np.uint8, count=rows * row_bytes).reshape(rows, row_bytes)
    pos = np.frombuffer(mem, dtype=np.int64, count=rows, offset=rows * row_bytes)
    tok = np.frombuffer(mem, dtype=np.int64, count=rows, offset=rows * (row_bytes + 8))
    return data, pos, tok


class _Slab:
    __slots__ = ("data", "file", "id", "mem", "members", "pos", "tok", "used")

    def __init__(self, prefix: str, sid: int, rows: int, row_bytes: int) -> None:
        self.id = sid
        self.file = slab_path(prefix, sid)
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, rows * (row_bytes + 16))
            self.mem = mmap.mmap(fd, rows * (row_bytes + 16))
        finally:
            os.close(fd)
        self.data, self.pos, self.tok = slab_arrays(self.mem, row_bytes)
        self.used = 0
        self.members: set[_Tap] = set()
        """Taps of registered requests with their region here."""

    @property
    def live(self) -> int:
        return len(self.members)

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file)
        self.data = self.pos = self.tok = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view refers to it: unmapped with it
            self.mem.close()


class _Tap:
    """One (request, sample, tap): its table entry and region."""

    __slots__ = ("base", "cap", "end", "entry", "last", "slab")

    def __init__(self, entry: int) -> None:
        self.entry = entry
        self.slab: _Slab | None = None
        self.base = self.cap = self.end = 0
        self.last = -1


class _Req:
    __slots__ = ("capacity", "reg", "taps")

    def __init__(self, reg: int, taps: dict[tuple[int, str], _Tap], capacity: int) -> None:
        self.reg, self.taps, self.capacity = reg, taps, capacity


class Receiver:
    def __init__(self, table_file: str, prefix: str, slab_bytes: int) -> None:
        fd = os.open(table_file, os.O_RDWR)
        try:
            self.table_mem = mmap.mmap(fd, table_bytes())
        finally:
            os.close(fd)
        self.head = np.frombuffer(self.table_mem, dtype=np.int64, count=HEADER)
        self.table = np.frombuffer(
            self.table_mem, dtype=np.int64, count=MAX_ENTRIES * ENTRY, offset=HEADER * 8
        ).reshape(MAX_ENTRIES, ENTRY)
        self.prefix = prefix
        self.slab_bytes = slab_bytes
        self.reqs: dict[tuple[str, int], _Req] = {}
        self.slabs: dict[int, _Slab] = {}
        self.filling: dict[int, _Slab] = {}
        self.spare: dict[int, _Slab] = {}
        self.next_slab = 0
        self.stash: dict[tuple[str, int], list[tuple]] = {}
        self.stash_bytes = 0
        self.inbuf = b""
        self.eof = False
        self.populate = _populator()

    # ------------------------------------------------------------- control
    def drain_control(self) -> None:
        while True:
            try:
                chunk = os.read(0, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            self.inbuf += chunk
        buf = self.inbuf
        while len(buf) >= 4:
            (n,) = struct.unpack_from("<I", buf)
            if len(buf) < 4 + n:
                break
            self.control(pickle.loads(buf[4 : 4 + n]))
            buf = buf[4 + n :]
        self.inbuf = buf

    def control(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "reg":
            _, key, reg, entries, capacity = msg
            taps = {}
            for tap, e in entries.items():
                row = self.table[e]
                row[SEQ] = 0
                row[SLAB] = -1
                row[BASE] = row[CAP] = row[END] = row[ENDED] = row[ROWB] = 0
                row[OWNER] = reg  # last: the entry is this registration's from here on
                taps[tap] = _Tap(e)
            self.reqs[key] = _Req(reg, taps, capacity)
            for item in self.stash.pop(key, ()):
                self.stash_bytes -= item[-1]
                self._file(key, *item[:5])
        elif kind == "release":
            req = self.reqs.pop(msg[1], None)
            if req is not None:
                touched = {t.slab for t in req.taps.values() if t.slab is not None}
                for t in req.taps.values():
                    self._leave(t)
                for slab in touched:
                    self._compact(slab)
            if not self.reqs:  # idle: keep no slab for requests to come
                self._idle()
        elif kind == "close":
            self.eof = True

    # ------------------------------------------------------------- slabs
    def _region(self, rows: int, row_bytes: int) -> tuple[_Slab, int]:
        slab = self.filling.get(row_bytes)
        if slab is None or slab.used + rows > len(slab.pos):
            if slab is not None:
                self.filling.pop(row_bytes)
                if slab.live == 0:
                    self._free(slab)
            slab = self._next(rows, row_bytes)
            self.filling[row_bytes] = slab
        base = slab.used
        slab.used += rows
        return slab, base

    def _next(self, rows: int, row_bytes: int) -> _Slab:
        usual = max(self.slab_bytes // (row_bytes + 16), 1)
        spare = self.spare.get(row_bytes)
        if spare is not None and len(spare.pos) >= rows:
            slab = self.spare.pop(row_bytes)
        else:  # faulted in ahead of the writes too: the thread soon runs ahead of them
            slab = self._new(max(usual, rows), row_bytes)
            if self.populate is not None:
                self.populate(slab.data)
        if self.populate is not None and row_bytes not in self.spare:
            self.spare[row_bytes] = nxt = self._new(usual, row_bytes)
            self.populate(nxt.data)
        return slab

    def _new(self, rows: int, row_bytes: int) -> _Slab:
        slab = _Slab(self.prefix, self.next_slab, rows, row_bytes)
        self.slabs[slab.id] = slab
        self.next_slab += 1
        return slab

    def _compact(self, slab: _Slab) -> None:
        """A full slab whose registered regions hold a quarter of its rows or less moves
        them out, so one long request keeps no more than its own rows alive."""
        if slab.data is None or slab.live == 0 or self._filling(slab):
            return
        if 4 * sum(t.cap for t in slab.members) <= len(slab.pos):
            for t in list(slab.members):
                self._move(t, t.cap, slab.data.shape[1], False)

    def _filling(self, slab: _Slab) -> bool:
        return self.filling.get(slab.data.shape[1]) is slab

    def _leave(self, t: _Tap, slab: _Slab | None = None) -> None:
        """``t`` has no region in ``slab`` (default: its own) any more."""
        slab = slab or t.slab
        if slab is None or slab.data is None:
            return
        slab.members.discard(t)
        if slab.live == 0 and not self._filling(slab):
            self._free(slab)

    def _idle(self) -> None:
        filling, self.filling = self.filling, {}
        spare, self.spare = self.spare, {}
        for slab in [*filling.values(), *spare.values()]:
            if slab.live == 0:
                self._free(slab)

    def _free(self, slab: _Slab) -> None:
        self.slabs.pop(slab.id, None)
        slab.free()

    def _move(self, t: _Tap, capacity: int, row_bytes: int, sort: bool) -> None:
        """The tap's rows into a new region of ``capacity`` rows (all of them: the
        front end's indices stay valid), published under the entry's sequence lock."""
        slab, base = self._region(capacity, row_bytes)
        n = t.end
        if t.slab is not None and n:
            src = slice(t.base, t.base + n)
            dst = slice(base, base + n)
            if sort:
                order = np.argsort(t.slab.pos[src], kind="stable")
                slab.pos[dst] = t.slab.pos[src][order]
                slab.tok[dst] = t.slab.tok[src][order]
                slab.data[dst] = t.slab.data[src][order]
            else:
                slab.pos[dst] = t.slab.pos[src]
                slab.tok[dst] = t.slab.tok[src]
                slab.data[dst] = t.slab.data[src]
        old = t.slab
        t.slab, t.base, t.cap = slab, base, capacity
        slab.members.add(t)
        if n:
            t.last = int(slab.pos[base + n - 1])
        row = self.table[t.entry]
        row[SEQ] += 1
        row[SLAB], row[BASE], row[CAP], row[END], row[ROWB] = slab.id, base, capacity, n, row_bytes
        row[SEQ] += 1
        if old is not None and old is not slab:
            self._leave(t, old)

    # ------------------------------------------------------------- rows
    def _file(self, key, tap, positions, token_ids, data, ended) -> None:
        """Rows of one request at one tap (and its end), registered or stashed."""
        req = self.reqs.get(key)
        if req is None:
            self._stash(key, (tap, positions, token_ids, data, ended))
            return
        t = req.taps.get(tap)
        if t is None:
            return  # a tap this request did not select
        k = len(positions)
        if k:
            rb = data.shape[1]
            if t.slab is None:
                self._move(t, max(req.capacity, k, MIN_CAPACITY), rb, False)
            elif t.end + k > t.cap:
                self._move(t, max(2 * (t.end + k), MIN_CAPACITY), rb, False)
            s, lo = t.slab, t.base + t.end
            s.pos[lo : lo + k] = positions
            s.tok[lo : lo + k] = token_ids
            s.data[lo : lo + k] = data
            first = int(positions[0])
            out_of_order = (t.end and first < t.last) or (
                k > 1 and bool((positions[1:] < positions[:-1]).any())
            )
            t.end += k
            t.last = int(positions[-1])
            if out_of_order:
                self._move(t, t.cap, rb, True)
            self.table[t.entry, END] = t.end
        if ended:
            self.table[t.entry, ENDED] = 1

    def _stash(self, key, item: tuple) -> None:
        size = item[3].nbytes + 64
        self._expire_stash()
        if self.stash_bytes + size > STASH_BYTES:
            self.head[H_STASH_DROPPED] += len(item[1])
            return
        pos, tok, data = (np.array(x) for x in item[1:4])  # the frame is not kept
        self.stash.setdefault(key, []).append(
            (item[0], pos, tok, data, item[4], time.monotonic(), size)
        )
        self.stash_bytes += size

    def _expire_stash(self) -> None:
        if not self.stash:
            return
        now = time.monotonic()
        for key in [k for k, v in self.stash.items() if now - v[0][5] > STASH_S]:
            for item in self.stash.pop(key):
                self.stash_bytes -= item[-1]

    def add(self, b: Any) -> None:
        """One message: single rows of a decode step written with one scatter per slab,
        pieces of several rows as slice copies; then the counts, then the ends."""
        import torch

        rows, tap = b.header.rows, (b.layer, b.hook)
        data = b.tensor.view(torch.uint8).numpy() if b.tensor.numel() else None
        offsets = rows.offsets.tolist()
        ids = rows.request_ids
        samples = rows.sample_index or [0] * len(ids)
        positions = rows.positions.tolist()
        ends = {(e.request_id, e.sample_index) for e in b.header.ended}
        reqs = self.reqs
        scatter: dict[_Slab, tuple[list[int], list[int]]] = {}
        counts: list[tuple[int, int]] = []
        for i, key in enumerate(zip(ids, samples, strict=True)):
            lo, hi = offsets[i], offsets[i + 1]
            if lo == hi or data is None:
                continue
            req = reqs.get(key)
            if req is None:
                self.drain_control()
                req = reqs.get(key)
            t = req.taps.get(tap) if req is not None else None
            if (
                hi - lo == 1
                and t is not None
                and t.slab is not None
                and t.end < t.cap
                and positions[lo] >= t.last
            ):
                src, dst = scatter.setdefault(t.slab, ([], []))
                src.append(lo)
                dst.append(t.base + t.end)
                t.end += 1
                t.last = positions[lo]
                counts.append((t.entry, t.end))
                continue
            self._file(key, tap, rows.positions[lo:hi], rows.token_ids[lo:hi], data[lo:hi], False)
        if scatter:
            items = data.view(f"V{data.shape[1]}").reshape(len(data))
            for slab, (src, dst) in scatter.items():
                d = np.asarray(dst, dtype=np.intp)
                s = slice(src[0], src[-1] + 1) if src[-1] - src[0] == len(src) - 1 else src
                slab.data.view(f"V{data.shape[1]}").reshape(len(slab.pos))[d] = items[s]
                slab.pos[d] = rows.positions[s]
                slab.tok[d] = rows.token_ids[s]
            e = np.array(counts, dtype=np.int64)
            self.table[e[:, 0], END] = e[:, 1]  # after the rows: a reader sees them there
        for key in ends:
            req = reqs.get(key)
            if req is None:
                self.drain_control()
                req = reqs.get(key)
            if req is None:
                self._stash(key, (tap, np.zeros(0, np.int64), np.zeros(0, np.int64),
                                  np.zeros((0, 0), np.uint8), True))  # fmt: skip
            elif tap in req.taps:
                self.table[req.taps[tap].entry, ENDED] = 1

    def close(self) -> None:
        for slab in list(self.slabs.values()):
            self._free(slab)


def _populator():
    """A thread that faults a slab's pages in ahead of use (Linux 5.14+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    import queue

    q: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        while True:
            data = q.get()  # the rows' array: it keeps the mapping while this runs
            fn(data.ctypes.data, data.nbytes, 23)  # MADV_POPULATE_WRITE (rows only)
            del data

    threading.Thread(target=run, name="actbus-prefault", daemon=True).start()
    return q.put


def main() -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    args = json.loads(sys.argv[1])
    parent = os.getppid()
    out = sys.stdout
    try:
        from actbus.bus.endpoints import Endpoints
        from actbus.bus.fanin import subscribe
        from actbus.bus.protocol import Subscription
        from actbus.bus.subscriber import Batch

        rec = Receiver(args["table"], args["prefix"], args["slab_bytes"])
        rec.head[H_PID] = os.getpid()
        addrs = args["addresses"]
        sub = subscribe(
            Endpoints(",".join(addrs), tuple(addrs)),
            Subscription(policy="block", returned_only=True, name="actbus-return"),
            keepalive=False,
        )
        try:
            welcome = sub.wait_welcome(args["welcome_s"], every=True)
        except (TimeoutError, RuntimeError) as e:
            sub.close()
            out.write(json.dumps({"ok": False, "error": str(e)}) + "\n")
            out.flush()
            return 1
    except Exception as e:
        out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ok": True, "welcome": welcome}, default=str) + "\n")
    out.flush()
    os.set_blocking(0, False)
    head = rec.head
    try:
        while not rec.eof and os.getppid() == parent:
            rec.drain_control()
            if rec.eof:
                break
            got = sub.recv(timeout=0.05)
            head[H_ALIVE_NS] = time.monotonic_ns()
            if isinstance(got, Batch):
                try:
                    rec.add(got)
                except Exception:  # a message that does not add up costs only itself
                    log.exception("actbus: the return receiver did not file a message")
                head[H_RECV_NS] = time.monotonic_ns()
                head[H_MSGS] += 1
                head[H_CPU_NS] = time.process_time_ns()
    finally:
        sub.close()
        rec.close()
        # The shared table and its folder go too (the parent may be gone; its own
        # mapping, if it is there, stays valid).
        with contextlib.suppress(OSError):
            os.unlink(args["table"])
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(args["table"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
