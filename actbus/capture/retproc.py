"""Returned activations received in a child process (``ACTBUS_RETURN_PROCESS``).

The in-process ``ReturnCollector`` receives and files rows on a thread that shares
the front end's GIL with vLLM's output processing; when that processing is busy, the
stream drains slower than the engine publishes, and the engine's host buffers of
earlier steps stay queued (issue 20). ``ProcessReturnCollector`` has the same
interface and guarantees, but its subscriber runs in a child process
(``actbus.capture.retchild``, started with ``subprocess``, never forked: the front end
holds threads and maybe CUDA), which writes rows into shared-memory slabs and
publishes per-(request, sample, tap) progress in a shared table. The front end's
per-request work is a registration when the request is added, a few reads of that
table and zero-copy views when it makes an output, and a release after the final one.

A view handed out maps the slab's file in this process; the child removes the file
once no registered request has rows there, and the memory goes when the last view
does. The child exits when this process closes its pipe or is gone; if it dies first,
the next output (or registration) raises ``ReturnReceiverError`` saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import mmap
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actbus.capture import retchild as rc
from actbus.capture.collector import (
    RETURN_TIMEOUT_S,
    SLOW_WAIT_S,
    STALL_S,
    Collector,
    Registry,
)
from actbus.capture.selection import Selection
from actbus.errors import ConfigError
from actbus.wire import DTYPES

log = logging.getLogger("actbus.retproc")
START_S = 60.0
"""The child's start (its imports) may take this long, besides the welcome wait."""
ENV = "ACTBUS_RETURN_PROCESS"


def enabled() -> bool:
    """Whether returned rows are received in a child process (``ACTBUS_RETURN_PROCESS``:
    ``1`` yes, ``0`` no, the in-process collector)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


SHM = "/dev/shm"
MIN_SHM_BYTES = 2 << 30
"""The receiver's slabs live in ``/dev/shm``; with less room free there than this (a
container's default is 64 MiB), rows are received in the front end's process instead:
a slab written past a full tmpfs would kill the receiver (SIGBUS)."""


def shm_room() -> str | None:
    """Why ``/dev/shm`` cannot hold the receiver's slabs, or None when it can."""
    try:
        st = os.statvfs(SHM)
    except OSError as e:
        return f"{SHM} is not there ({e})"
    free = st.f_bavail * st.f_frsize
    if free < MIN_SHM_BYTES:
        return f"{SHM} has {free >> 20} MiB free, under {MIN_SHM_BYTES >> 20} MiB"
    return None


class ReturnReceiverError(RuntimeError):
    """The child process receiving returned rows is gone."""


@dataclass
class _Pending:
    sel: Selection
    prompt_len: int
    reg: int
    entries: dict[tuple[int, str], int]
    start: dict[tuple[int, str], int] = field(default_factory=dict)
    """Rows handed out per tap (DELTA)."""
    created: float = field(default_factory=time.monotonic)


class ProcessReturnCollector:
    """The front end's collector of returned rows, receiving in a child process."""

    where = "extra_args.actbus.return"
    what = "rows"
    registry: Registry

    def __init__(self, addresses: str | list[str], slab_bytes: int = rc.SLAB_BYTES) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.address = ",".join(addresses)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._free = list(range(rc.MAX_ENTRIES - 1, -1, -1))
        self._reg = 0
        self._maps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._waits = [0, 0.0, 0.0, 0]
        self._closed = False
        self._checked_at = time.monotonic()
        self._dir = tempfile.mkdtemp(prefix="actbus-ret-", dir=SHM)
        self._table_file = os.path.join(self._dir, "table")
        fd = os.open(self._table_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, rc.table_bytes())
            self._table_mem = mmap.mmap(fd, rc.table_bytes())
        finally:
            os.close(fd)
        self._head = np.frombuffer(self._table_mem, dtype=np.int64, count=rc.HEADER)
        self._table = np.frombuffer(
            self._table_mem, dtype=np.int64, count=rc.MAX_ENTRIES * rc.ENTRY, offset=rc.HEADER * 8
        ).reshape(rc.MAX_ENTRIES, rc.ENTRY)
        self._prefix = os.path.join(self._dir, "slab")
        args = {
            "addresses": addresses,
            "table": self._table_file,
            "prefix": self._prefix,
            "slab_bytes": slab_bytes,
            "welcome_s": RETURN_TIMEOUT_S,
        }
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "actbus.capture.retchild", json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        _CHILDREN.add(self)
        try:
            hello = self._hello()
        except BaseException:
            self._shutdown(kill=True)
            raise
        self.welcome: dict[str, Any] = hello.get("welcome") or {}
        self._dtype = DTYPES.get(self.welcome.get("dtype", "float32"), torch.float32)
        self._width = int(self._welcome_hidden())
        self._itemsize = torch.empty(0, dtype=self._dtype).element_size()
        log.info("actbus: returned rows from %s are received in process %d", self.address, self.pid)

    def _welcome_hidden(self) -> int:
        return int(self.welcome.get("hidden_size", 0))

    def _hello(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], START_S + RETURN_TIMEOUT_S)
        line = self._proc.stdout.readline() if ready else b""
        try:
            hello = json.loads(line) if line else {"ok": False, "error": "no answer"}
        except ValueError:
            hello = {"ok": False, "error": f"answered {line[:200]!r}"}
        if not hello.get("ok"):
            raise ConfigError(
                f"{self.where}: the publisher at {self.address} did not answer the return "
                f"receiver ({hello.get('error')})"
            )
        return hello

    # ------------------------------------------------------------- registries
    @classmethod
    def for_config(cls, cfg: Any, dp: Any = None) -> ProcessReturnCollector:
        addrs = Collector.refuse.__func__(cls, cfg, dp, "subscribe to the bus instead")
        return cls.registry.get(addrs, cls)  # type: ignore[return-value]

    # ------------------------------------------------------------- front end side
    def _send(self, msg: tuple) -> None:
        """Under ``_lock``."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(struct.pack("<I", len(data)) + data)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._check_alive()
            raise

    def _check_alive(self) -> None:
        code = self._proc.poll()
        if code is not None or self._closed:
            raise ReturnReceiverError(
                f"actbus: the process receiving returned activations (pid {self._proc.pid}) "
                f"{'was closed' if self._closed else f'exited with code {code}'}; rows of "
                "requests that return activations cannot be delivered. Its error, if any, is "
                "in this process' stderr; restart the engine to start a new one"
            )

    def expect(
        self,
        caller_id: str,
        n: int,
        sel: Selection,
        prompt_len: int,
        max_tokens: int | None = None,
    ) -> None:
        """Register a request's ``n`` samples (with the child) before it is queued."""
        from actbus.capture.activations import CAPACITY_CAP, CAPACITY_GUESS, _expected_rows

        budget = prompt_len + (max_tokens if max_tokens else CAPACITY_GUESS) - 1
        rows = _expected_rows(sel, prompt_len, min(budget, prompt_len + CAPACITY_CAP))
        capacity = 1 if rows is None else rows
        with self._lock:
            self._check_alive()
            if len(self._free) < n * len(sel.keys):
                raise ConfigError(
                    f"{self.where}: more than {rc.MAX_ENTRIES} (request, sample, tap) "
                    "entries returning activations in flight; retry when fewer are"
                )
            for i in range(n):
                key = (caller_id, i)
                if key in self._pending:
                    self._release(key)
                self._reg += 1
                entries = {k: self._free.pop() for k in sel.keys}
                for e in entries.values():
                    self._table[e, rc.OWNER] = 0  # not this registration's until the child says
                self._pending[key] = _Pending(sel, prompt_len, self._reg, entries)
                self._send(("reg", key, self._reg, entries, capacity))
            self.registry.owner[caller_id] = self  # type: ignore[assignment]
            self._forget_stale()

    def _release(self, key: tuple[str, int]) -> None:
        """Under ``_lock``: the child may reuse nothing of this request's but its table
        entries, whose reuse the registration number guards."""
        p = self._pending.pop(key, None)
        if p is None:
            return
        with contextlib.suppress(ReturnReceiverError, OSError):
            self._send(("release", key))
        self._free.extend(p.entries.values())

    def _read(self, e: int) -> np.ndarray:
        """A consistent copy of a table entry (its region does not move meanwhile)."""
        row = self._table[e]
        while True:
            seq = int(row[rc.SEQ])
            if seq & 1:
                time.sleep(0)
                continue
            v = row.copy()
            if int(row[rc.SEQ]) == seq:
                return v

    def _region(self, p: _Pending, tap: tuple[int, str]):
        """(positions, token ids, rows) arrays of a tap's rows written, and its end flag."""
        e = p.entries[tap]
        for _ in range(100):
            v = self._read(e)
            if v[rc.OWNER] != p.reg or v[rc.SLAB] < 0:
                return None, bool(v[rc.OWNER] == p.reg and v[rc.ENDED])
            try:
                data, pos, tok = self._map(int(v[rc.SLAB]), int(v[rc.ROWB]))
            except FileNotFoundError:  # moved and freed since read: read again
                continue
            base, end = int(v[rc.BASE]), int(min(v[rc.END], v[rc.CAP]))
            return (pos[base : base + end], tok[base : base + end], data[base : base + end]), bool(
                v[rc.ENDED]
            )
        raise ReturnReceiverError(f"actbus: a returned region of entry {e} kept moving")

    def _map(self, slab: int, row_bytes: int):
        got = self._maps.get(slab)
        if got is None:
            fd = os.open(rc.slab_path(self._prefix, slab), os.O_RDWR)
            try:
                mem = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            got = self._maps[slab] = rc.slab_arrays(mem, row_bytes)
        return got

    def take(
        self,
        caller_id: str,
        index: int,
        num_generated: int,
        *,
        final: bool,
        delta: bool,
        ends_follow: bool = True,
    ):
        """As ``ReturnCollector.take``: views of the rows below the output's positions."""
        from actbus.capture.activations import Activations, _expected_rows

        key = (caller_id, index)
        with self._lock:
            p = self._pending.get(key)
        if p is None:
            return None
        self._check_alive()
        limit = p.prompt_len + num_generated - 1
        want = wait = None
        if final:
            want = _expected_rows(p.sel, p.prompt_len, limit)
            wait = RETURN_TIMEOUT_S if (want is not None or ends_follow) else 0.0
            self._wait_final(lambda: self._arrived(p, limit, want), wait)
        regions = {k: self._region(p, k) for k in p.sel.keys}
        counts = []
        for k in p.sel.keys:
            arrays, _ = regions[k]
            s = p.start.get(k, 0)
            counts.append(int(np.searchsorted(arrays[0][s:], limit)) if arrays else 0)
        n = min(counts) if counts else 0
        tensors = {}
        positions = token_ids = _NO_IDS
        for k in p.sel.keys:
            arrays, _ = regions[k]
            if arrays is None:
                tensors[k] = torch.empty((0, self._width), dtype=self._dtype)
                continue
            s = p.start.get(k, 0)
            pos, tok, data = arrays
            positions = torch.from_numpy(pos[s : s + n])
            token_ids = torch.from_numpy(tok[s : s + n])
            width = data.shape[1] // self._itemsize
            tensors[k] = torch.from_numpy(data[s : s + n]).view(self._dtype).view(n, width)
            if delta:
                p.start[k] = s + n
        acts = Activations(positions, token_ids, tensors, complete=False)
        if final:
            acts.complete = self._arrived(p, limit, want)
            with self._lock:
                if self._pending.get(key) is p:
                    self._release(key)
                owner = self.registry.owner
                if owner.get(caller_id) is self and not any(
                    k[0] == caller_id for k in self._pending
                ):
                    owner.pop(caller_id, None)
                if not self._pending:
                    self._maps.clear()  # views handed out keep their own mappings
            if not acts.complete and wait:
                log.warning(
                    "actbus: request %s sample %d: %d of %s rows arrived before its final "
                    "output", caller_id, index, len(acts.positions), want,
                )  # fmt: skip
        return acts

    def _arrived(self, p: _Pending, limit: int, want: int | None) -> bool:
        for k in p.sel.keys:
            arrays, ended = self._region(p, k)
            if ended:
                continue
            if want is None or arrays is None or int(np.searchsorted(arrays[0], limit)) < want:
                return False
        return True

    def _wait_final(self, arrived, bound: float) -> bool:
        ok = arrived()
        if ok or bound <= 0:
            return ok
        t0 = time.monotonic()
        deadline = t0 + bound
        nap = 0.0002
        while True:
            now = time.monotonic()
            quiet = now - max(self._head[rc.H_RECV_NS] / 1e9, t0)
            if now >= deadline or quiet >= STALL_S:
                break
            self._check_alive()
            time.sleep(nap)
            nap = min(nap * 2, 0.005)
            if arrived():
                ok = True
                break
        waited = time.monotonic() - t0
        with self._lock:
            w = self._waits
            w[0], w[1], w[2], w[3] = w[0] + 1, w[1] + waited, max(w[2], waited), w[3] + (not ok)
        if waited > SLOW_WAIT_S:
            log.warning(
                "actbus: a final output waited %.2f s for its request's last %s (%s)",
                waited, self.what, "they came" if ok else "gave up",
            )  # fmt: skip
        return ok

    def _forget_stale(self) -> None:
        """Under ``_lock``, every second: forget requests nobody will collect (ended
        long ago, or never seen by an engine), and mappings of slabs gone."""
        from actbus.capture.collector import FORGET_AFTER_S, FORGET_UNENDED_S

        now = time.monotonic()
        if now - self._checked_at < 1.0:
            return
        self._checked_at = now
        stale = []
        for key, p in self._pending.items():
            ended = all(
                self._table[e, rc.OWNER] == p.reg and self._table[e, rc.ENDED]
                for e in p.entries.values()
            )
            age = now - p.created
            if (ended and age > FORGET_AFTER_S) or age > FORGET_UNENDED_S:
                stale.append(key)
        for key in stale:
            self._release(key)
        for slab in [s for s in self._maps if not os.path.exists(rc.slab_path(self._prefix, s))]:
            del self._maps[slab]

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def stats(self) -> dict[str, float]:
        with self._lock:
            n, total, longest, gave_up = self._waits
        return {
            "final_waits": n,
            "final_wait_s": round(total, 6),
            "final_wait_max_s": round(longest, 6),
            "final_gave_up": gave_up,
            "recv_cpu_s": round(int(self._head[rc.H_CPU_NS]) / 1e9, 6),
            "recv_messages": int(self._head[rc.H_MSGS]),
            "recv_process": 1,
        }

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        self._shutdown(kill=False)

    def _shutdown(self, kill: bool) -> None:
        if self._closed:
            return
        _CHILDREN.discard(self)
        with self._lock:
            try:
                if not kill and self._proc.poll() is None:
                    self._send(("close",))
            except (ReturnReceiverError, OSError, ValueError):
                pass
            self._closed = True
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=0.1 if kill else 5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._maps.clear()
        names = os.listdir(self._dir) if os.path.isdir(self._dir) else []
        for name in names:  # the child's, if it died before removing them
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


_NO_IDS = torch.zeros(0, dtype=torch.int64)
_CHILDREN: weakref.WeakSet[ProcessReturnCollector] = weakref.WeakSet()


@atexit.register
def _close_children() -> None:
    for col in list(_CHILDREN):
        with contextlib.suppress(Exception):
            col._shutdown(kill=True)
