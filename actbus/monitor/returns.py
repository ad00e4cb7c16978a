"""Monitor scores handed back to the caller (``extra_args["actbus"]["monitor_return"]``).

Scores are published on the bus like any others (``actbus.monitor.worker``). The front
end (``LLM``, ``AsyncLLM``, the OpenAI server) runs one lossless subscriber of its own
to the ``monitor`` hook, filtered at the publisher to the requests that asked
(``Subscription.returned_only``, the worker marks them ``returned``), and attaches
what has arrived to each output of such a request as ``CompletionOutput.monitor_scores``
(a ``MonitorScores``). So the caller gets the very values any bus subscriber gets.

Every output covers positions ``0 .. prompt_len + n_generated - 2``: the tokens fed
to the model so far (the last generated token is scored once it is fed, so never).
A streamed output carries the scores that have arrived, the same prefix of positions
for every (monitor, layer); DELTA outputs carry each position once, CUMULATIVE ones
all so far. The final output waits, bounded by ``RETURN_TIMEOUT_S``, until every
position's score is there (or the request's end came on that monitor's stream) and
says in ``complete`` whether it got them all.

Memory per request is its scores alone (``tokens x width x 4`` bytes per monitor and
layer); a DELTA reader's scores are let go once handed out. A request whose caller
went away is forgotten at once (``forget``, from the output processor's abort) or,
failing that, ``FORGET_AFTER_S`` after its end.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actbus.bus.addresses import connectable
from actbus.bus.endpoints import Endpoints
from actbus.bus.fanin import subscribe
from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch
from actbus.errors import ConfigError
from actbus.wire import MONITOR_HOOK

log = logging.getLogger("actbus.monitor.returns")
RETURN_TIMEOUT_S = 30.0
FORGET_AFTER_S = 120.0
"""An ended request nobody collected (aborted offline, client gone) is forgotten after this,"""
FORGET_UNENDED_S = 24 * 3600.0
"""and one that never reached the engine (so no end ever comes) after this."""
WHERE = "extra_args.actbus.monitor_return"
INITIAL_BYTES = 1 << 20
"""A series starts with room for its token budget, at most this much (wide SAE monitors)."""

Stream = tuple[str, int]
"""(monitor name, layer): one series of scores."""


@dataclass
class MonitorScores:
    """One request's (one sample's) returned scores, rows in position order.

    Every (monitor, layer) series has a row for each of ``positions``; ``values`` are
    float32 ``[n, width]`` (width 1 for a probe or a raw direction, the listed
    features for an SAE, named by ``labels``), ``versions`` int64 ``[n]``: the version
    of the monitor's weights that produced each row."""

    positions: torch.Tensor
    """int64 ``[n]``: token positions (prompt first)."""
    token_ids: torch.Tensor
    """int64 ``[n]``: the token fed at each position."""
    values: dict[Stream, torch.Tensor]
    versions: dict[Stream, torch.Tensor]
    labels: dict[str, tuple[int, ...]]
    complete: bool
    """Every position's score is here for every series (final outputs)."""

    def __getitem__(self, key: str | Stream) -> torch.Tensor:
        """``scores["toxic"]`` (a monitor at one layer) or ``scores["toxic", 16]``."""
        if isinstance(key, tuple):
            return self.values[key]
        layers = [lay for name, lay in self.values if name == key]
        if len(layers) != 1:
            have = sorted({n for n, _ in self.values})
            raise KeyError(
                f"monitor {key!r} has scores at layers {layers}; index with (name, layer)"
                if layers
                else f"no monitor {key!r} in these scores (have {have})"
            )
        return self.values[(key, layers[0])]

    @staticmethod
    def join(first: MonitorScores | None, then: MonitorScores) -> MonitorScores:
        """Two consecutive DELTA pieces as one (vLLM merges outputs a slow reader has
        not taken yet)."""
        if first is None:
            return then
        return MonitorScores(
            torch.cat([first.positions, then.positions]),
            torch.cat([first.token_ids, then.token_ids]),
            {k: torch.cat([first.values[k], v]) for k, v in then.values.items()},
            {k: torch.cat([first.versions[k], v]) for k, v in then.versions.items()},
            then.labels,
            then.complete,
        )

    def to_json(self, final: bool) -> dict[str, Any]:
        """The HTTP form (``choices[i].actbus.monitor``); see docs/monitors.md.

        Each value is the shortest decimal that reads back as the same float32, so a
        client's ``np.float32(x)`` is the exact score; a non-finite one is ``null``."""
        scores: dict[str, list[dict[str, Any]]] = {}
        for (name, layer), v in self.values.items():
            entry: dict[str, Any] = {
                "layer": layer,
                "version": self.versions[(name, layer)].tolist(),
                "values": _shortest(v.numpy()),
            }
            if self.labels.get(name):
                entry["labels"] = list(self.labels[name])
            scores.setdefault(name, []).append(entry)
        out: dict[str, Any] = {
            "positions": self.positions.tolist(),
            "token_ids": self.token_ids.tolist(),
            "scores": scores,
        }
        if final:
            out["complete"] = self.complete
        return out


def _shortest(a: np.ndarray) -> list[list[float | None]]:
    """float32 ``[n, w]`` as nested lists of doubles whose shortest repr is the float32's."""
    text = a.astype(np.float32).astype(str).tolist()
    finite = np.isfinite(a).tolist()
    return [
        [float(t) if ok else None for t, ok in zip(row, oks, strict=True)]
        for row, oks in zip(text, finite, strict=True)
    ]


class _Series:
    """One stream's rows of one request: growable arrays, handed out as views."""

    def __init__(self, width: int, capacity: int) -> None:
        self.width = width
        self._alloc(max(capacity, 4))
        self.start = 0  # rows before it were handed out (DELTA)
        self.end = 0

    def _alloc(self, cap: int, keep_from: int = 0) -> None:
        old = getattr(self, "pos", None)
        n = (self.end - keep_from) if old is not None else 0
        pos, tok = np.empty(cap, np.int64), np.empty(cap, np.int64)
        ver, val = np.empty(cap, np.int64), np.empty((cap, self.width), np.float32)
        if old is not None:
            pos[:n], tok[:n] = self.pos[keep_from : self.end], self.tok[keep_from : self.end]
            ver[:n], val[:n] = self.ver[keep_from : self.end], self.val[keep_from : self.end]
        self.pos, self.tok, self.ver, self.val = pos, tok, ver, val

    def append(self, pos: np.ndarray, tok: np.ndarray, version: int, val: np.ndarray) -> None:
        k = len(pos)
        if self.end + k > len(self.pos):
            # Fresh arrays (never in place): views handed out earlier stay valid.
            # Rows a DELTA reader took are dropped here.
            live = self.end - self.start
            self._alloc(max(2 * (live + k), 16), keep_from=self.start)
            self.end, self.start = live, 0
        self.pos[self.end : self.end + k] = pos
        self.tok[self.end : self.end + k] = tok
        self.ver[self.end : self.end + k] = version
        self.val[self.end : self.end + k] = val
        self.end += k

    def pending_below(self, limit: int) -> int:
        return int(np.searchsorted(self.pos[self.start : self.end], limit))


@dataclass
class _Pending:
    prompt_len: int
    capacity: int
    streams: tuple[Stream, ...]
    series: dict[Stream, _Series] = field(default_factory=dict)
    handed: int = 0
    """Rows (per stream) handed out to DELTA outputs so far."""
    labels: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ended_streams: set[Stream] = field(default_factory=set)
    ended_at: float | None = None
    created: float = field(default_factory=time.monotonic)


_EMPTY = np.zeros(0, np.int64)


class ScoreCollector:
    """The front end's subscriber for returned scores, shared by its requests (one per
    set of publishers; under data parallelism it reads every rank it serves)."""

    def __init__(self, addresses: list[str]) -> None:
        self.address = ",".join(addresses)
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._cond = threading.Condition()
        self._sub = subscribe(
            Endpoints(self.address, tuple(addresses)),
            Subscription(
                policy="block", hooks=(MONITOR_HOOK,), returned_only=True, name="actbus-scores"
            ),
            keepalive=False,
        )
        try:  # scores routed before the subscription is in place would never come
            self._sub.wait_welcome(RETURN_TIMEOUT_S, every=True)
        except (TimeoutError, RuntimeError) as e:
            self._sub.close()
            raise ConfigError(
                f"{WHERE}: the publisher at {self.address} did not answer ({e})"
            ) from None
        self._forgot_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="actbus-scores", daemon=True)
        self._thread.start()

    @classmethod
    def for_config(cls, cfg: Any, dp: Any = None) -> ScoreCollector:
        """The collector of the publishers of the data-parallel ranks ``dp`` serves
        (default: rank 0); refuses what it cannot reach."""
        if cfg.server_secret_key:
            raise ConfigError(
                f"{WHERE}: the publisher uses CURVE keys, which the front end does not hold; "
                "use an ipc:// or loopback publish address, or read scores with ScoreReader"
            )
        if dp is not None and dp.remote:
            raise ConfigError(
                f"{WHERE}: this front end sends requests to data-parallel ranks "
                f"{list(dp.remote)} on other nodes, whose publishers it cannot reach; run "
                "each node's ranks behind a front end of its own, or read scores with ScoreReader"
            )
        addrs = [connectable(cfg.publish_address(r)) for r in (dp.served if dp else (0,))]
        key = ",".join(addrs)
        with _LOCK:
            if key not in _COLLECTORS:
                _COLLECTORS[key] = cls(addrs)
            return _COLLECTORS[key]

    # ------------------------------------------------------------- front end side
    def expect(
        self,
        caller_id: str,
        n: int,
        streams: tuple[Stream, ...],
        prompt_len: int,
        max_tokens: int | None = None,
    ) -> None:
        """Register a request's ``n`` samples before it is queued."""
        capacity = prompt_len + min(max_tokens or 256, 4096)
        with self._cond:
            for i in range(n):
                self._pending[(caller_id, i)] = _Pending(prompt_len, capacity, streams)
            _OWNER[caller_id] = self

    def pending(self) -> int:
        """Samples registered and not collected or forgotten yet."""
        with self._cond:
            return len(self._pending)

    def forget(self, caller_ids: list[str]) -> None:
        """Drop these requests' scores: their caller went away."""
        with self._cond:
            for key in [k for k in self._pending if k[0] in caller_ids]:
                del self._pending[key]
        for c in caller_ids:
            if _OWNER.get(c) is self:
                _OWNER.pop(c, None)

    def take(
        self,
        caller_id: str,
        index: int,
        num_generated: int,
        *,
        final: bool,
        delta: bool,
        wait: bool = True,
    ) -> MonitorScores | None:
        """The scores for an output with ``num_generated`` tokens so far; a final one
        waits for the missing ones (bounded) unless ``wait`` is false (an abort)."""
        key = (caller_id, index)
        with self._cond:
            p = self._pending.get(key)
            if p is None:
                return None
            limit = p.prompt_len + num_generated - 1  # positions fed so far
            if final:
                deadline = time.monotonic() + (RETURN_TIMEOUT_S if wait else 0.0)
                while not self._arrived(p, limit):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.5))
                del self._pending[key]
                if not any(k[0] == caller_id for k in self._pending):
                    _OWNER.pop(caller_id, None)
            out = self._hand_out(p, limit, delta)
            if final:
                out.complete = self._arrived(p, limit)
        if final and wait and not out.complete:
            log.warning(
                "actbus: request %s sample %d: %d of %d positions' scores arrived within %.0f s",
                caller_id, index, len(out.positions), limit, RETURN_TIMEOUT_S,
            )  # fmt: skip
        return out

    @staticmethod
    def _arrived(p: _Pending, limit: int) -> bool:
        """Every stream has a score for each position below ``limit``, or its end came
        (a stream's messages arrive in order, the end after its last scores)."""
        for s in p.streams:
            if s in p.ended_streams:
                continue
            ser = p.series.get(s)
            if ser is None or p.handed + ser.pending_below(limit) < limit:
                return False
        return True

    def _hand_out(self, p: _Pending, limit: int, delta: bool) -> MonitorScores:
        series = [p.series.get(s) for s in p.streams]
        n = min((ser.pending_below(limit) if ser else 0) for ser in series) if series else 0
        values, versions = {}, {}
        positions = token_ids = _EMPTY
        for s, ser in zip(p.streams, series, strict=True):
            if ser is None:
                values[s] = torch.zeros((0, 0), dtype=torch.float32)
                versions[s] = torch.zeros(0, dtype=torch.int64)
                continue
            lo = ser.start
            positions, token_ids = ser.pos[lo : lo + n], ser.tok[lo : lo + n]
            values[s] = torch.from_numpy(ser.val[lo : lo + n])
            versions[s] = torch.from_numpy(ser.ver[lo : lo + n])
            if delta:
                ser.start += n
        if delta:
            p.handed += n
        return MonitorScores(
            torch.from_numpy(positions),
            torch.from_numpy(token_ids),
            values,
            versions,
            dict(p.labels),
            complete=False,
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close()

    # ------------------------------------------------------------- receiving side
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = self._sub.recv(timeout=0.5)
            except Exception:  # keep collecting; a request that misses scores says so
                log.exception("actbus: score return subscriber failed; retrying")
                time.sleep(0.5)
                continue
            if isinstance(out, Batch):
                self._add(out)
            self._forget_stale()

    def _add(self, b: Batch) -> None:
        h, rows = b.header, b.header.rows
        mon = h.monitor
        if mon is None:
            return
        stream = (mon.name, h.layer)
        values = b.tensor.numpy() if b.tensor.numel() else None
        offsets = rows.offsets.tolist()
        with self._cond:
            for i, rid in enumerate(rows.request_ids if values is not None else ()):
                p = self._pending.get((rid, rows.request_sample_index(i)))
                lo, hi = offsets[i], offsets[i + 1]
                if p is None or hi == lo or stream not in p.streams:
                    continue  # another front end's request, or one already collected
                ser = p.series.get(stream)
                if ser is None:  # room for the token budget, or 1 MiB to start (it grows)
                    width = values.shape[1]
                    cap = min(p.capacity, max(16, INITIAL_BYTES // (4 * max(width, 1))))
                    ser = p.series[stream] = _Series(width, cap)
                    p.labels[mon.name] = tuple(mon.labels)
                ser.append(rows.positions[lo:hi], rows.token_ids[lo:hi], mon.version, values[lo:hi])
            now = time.monotonic()
            for end in h.ended:
                p = self._pending.get((end.request_id, end.sample_index))
                if p is not None:
                    p.ended_streams.add(stream)
                    p.ended_at = p.ended_at or now
            self._cond.notify_all()

    def _forget_stale(self) -> None:
        now = time.monotonic()
        if now - self._forgot_at < 1.0:
            return
        self._forgot_at = now
        with self._cond:
            stale = [
                k
                for k, p in self._pending.items()
                if (p.ended_at is not None and now - p.ended_at > FORGET_AFTER_S)
                or now - p.created > FORGET_UNENDED_S
            ]
            for key in stale:
                del self._pending[key]
            live = {k[0] for k in self._pending}
            for caller_id in {k[0] for k in stale} - live:
                _OWNER.pop(caller_id, None)


_LOCK = threading.Lock()
_COLLECTORS: dict[str, ScoreCollector] = {}
_OWNER: dict[str, ScoreCollector] = {}
"""Caller id -> the collector holding its scores, for the output processor's wrapper."""


def collector_for(caller_id: str) -> ScoreCollector | None:
    return _OWNER.get(caller_id)


def forget(caller_ids: list[str]) -> None:
    """Drop the scores of requests whose caller went away (an abort)."""
    for col in {id(c): c for c in (_OWNER.get(r) for r in caller_ids) if c}.values():
        col.forget(caller_ids)


def close_collectors(addresses: list[str]) -> int:
    """Close the collectors reading any of these publishers, whose engine stopped."""
    gone = {connectable(a) for a in addresses}
    with _LOCK:
        keys = [k for k in _COLLECTORS if gone.intersection(k.split(","))]
        closing = [_COLLECTORS.pop(k) for k in keys]
    for col in closing:
        for caller in [c for c, owner in list(_OWNER.items()) if owner is col]:
            _OWNER.pop(caller, None)
        col.close()
    return len(closing)
