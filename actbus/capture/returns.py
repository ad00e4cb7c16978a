"""Activations handed back to the caller (``extra_args["actbus"]["return"] = true``).

Rows are captured in the worker process and published like any others. The front
end (the process that took the request: ``LLM``, ``AsyncLLM``, the OpenAI server)
runs one lossless subscriber of its own, filtered at the publisher to the requests
that asked (``Subscription.returned_only``), and attaches what has arrived to each
output of such a request as ``CompletionOutput.activations``. So the data takes
the same path, with the same exactness, as what any other subscriber gets.

The front end's own work is kept off vLLM's output processing, with which it shares
the GIL. The subscriber's thread (its life shared with the returned scores':
``actbus.collector``) copies each message's rows straight into per-request
buffers sized from the request's token budget (``actbus.rowstore``), with the
message's row index unpacked once for all of its requests and taps. The buffers are
regions of slabs shared by many requests, so a decode step's single rows (one per
request) are written with one numpy scatter per slab: numpy copies without the GIL,
and what is left under it is a few Python operations per request to note where each
row goes. Making an output then costs a few views of those buffers, whatever the
request's length: no chunks concatenated, no copies handed out, and the lock the
receiving thread needs is held for microseconds. Tensors are views, shared between a
request's CUMULATIVE outputs: clone one before writing to it in place; a view kept
keeps its slab's rows alive.

Every output covers positions ``0 .. prompt_len + n_generated - 2``, the tokens
the model has been fed so far. A streamed (partial) output carries the rows that
have arrived, a prefix of those; the final output waits (bounded: see
``actbus.collector``) until every row its tokens imply is there (for
``positions="last"``, until the request's end event), and says in ``complete``
whether it got them all.

A sample streamed over HTTP with its rows inline is ``chunked``: its outputs carry a
``Due`` (the position its tokens reach) instead of rows, and each SSE chunk made from
them takes its own tokens' rows with ``rows_for``, waiting for them on the event loop
without blocking it (``actbus.engine.responses``). Its rows are handed out by its
chunks alone, in order, so a chunk carries exactly its tokens' rows whatever outputs
were merged before vLLM read them, and its final output waits for nothing in vLLM's
output processing (which every request's outputs share).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch
from actbus.capture.selection import Selection
from actbus.collector import (  # noqa: F401  (the timeouts: named here too)
    FORGET_AFTER_S,
    FORGET_UNENDED_S,
    RETURN_TIMEOUT_S,
    STALL_S,
    Collector,
    Registry,
)
from actbus.rowstore import Slab, SlabPool, TapRows, as_items, retire
from actbus.wire import DTYPES, RowIndex

log = logging.getLogger("actbus.returns")
CAPACITY_GUESS = 256
"""Generated tokens to make room for when a request sets no ``max_tokens``,"""
CAPACITY_CAP = 4096
"""and room for at most this many beyond its prompt at first (buffers grow past it)."""


@dataclass
class Activations:
    """One request's (one sample's) captured rows, in position order."""

    positions: torch.Tensor
    """int64 ``[n]``: token positions in the sequence (prompt first)."""
    token_ids: torch.Tensor
    """int64 ``[n]``: the token fed at each position."""
    tensors: dict[tuple[int, str], torch.Tensor]
    """``(layer, hook)`` -> ``[n, hidden]``, rows aligned with ``positions``."""
    complete: bool
    """Every row the selection implies for these tokens is here (final outputs)."""
    late: int = 0
    """A streamed chunk's rows (per tap) that its tokens and its choice's earlier
    chunks' imply and that had not arrived within the chunk's wait: a later chunk of
    the choice carries them."""

    def __getitem__(self, key: tuple[int, str]) -> torch.Tensor:
        return self.tensors[key]

    @staticmethod
    def join(first: Activations | None, then: Activations) -> Activations:
        """Two consecutive DELTA pieces as one (vLLM merges outputs a slow reader
        has not taken yet)."""
        if first is None:
            return then
        return Activations(
            torch.cat([first.positions, then.positions]),
            torch.cat([first.token_ids, then.token_ids]),
            {k: torch.cat([first.tensors[k], t]) for k, t in then.tensors.items()},
            then.complete,
        )


@dataclass(eq=False)
class Due:
    """What an output of a ``chunked`` sample owes the SSE chunk made from it: its rows
    below ``limit`` (``prompt_len + generated - 1``), taken by the chunk with
    ``ReturnCollector.rows_for``, so they follow the chunk's tokens, not the output."""

    collector: ReturnCollector
    key: tuple[str, int]
    limit: int
    final: bool
    ends_follow: bool = True
    """False when the front end ended the request (a stop string): see ``take``."""

    @staticmethod
    def join(first: Due | None, then: Due) -> Due:
        """Outputs merged before vLLM read them owe what the later one owes (its
        limit covers the earlier one's tokens)."""
        return then


@dataclass(eq=False)
class _Waiter:
    """A chunk awaiting its rows: the taps still short of ``want`` rows below ``limit``
    (or of the request's end), and the future the receiving thread resolves."""

    limit: int
    want: int | None
    short: set[tuple[int, str]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass
class _Pending:
    sel: Selection
    prompt_len: int
    capacity: int
    """Rows per tap to make room for at first: what the request's token budget implies."""
    chunked: bool = False
    """Its rows go out by its SSE chunks (``rows_for``), not by its outputs."""
    taps: dict[tuple[int, str], TapRows] = field(default_factory=dict)
    ended: str | None = None
    ended_at: float = 0.0
    ended_taps: set[tuple[int, str]] = field(default_factory=set)
    """Taps whose stream carried the request's end: all of its rows there have come."""
    created: float = field(default_factory=time.monotonic)

    @property
    def chunks(self) -> dict[tuple[int, str], list[tuple[torch.Tensor, ...]]]:
        """Per tap, the rows held and not handed out yet: (positions, token ids, rows)."""
        return {
            k: [t.view(t.start, t.end)] if t.end > t.start else [] for k, t in self.taps.items()
        }


class ReturnCollector(Collector):
    """The front end's subscriber for returned activations, shared by its requests.

    Under data parallelism the front end's requests go to several engine cores, each
    with its publisher: it reads all of them (fan-in). A request's rows come from the
    one rank that ran it, and request ids are the front end's own, unique across its
    ranks, so rows are matched by id alone."""

    batched = True
    """Write a decode step's single rows with one scatter per slab (False: a call per
    request, the previous way; benchmarks/bench_return_collector.py measures both)."""

    where = "extra_args.actbus.return"
    thread_name = "actbus-return"
    registry = Registry()

    def __init__(self, addresses: str | list[str]) -> None:
        """``addresses``: the publisher, or those of the front end's ranks."""
        self._slabs = SlabPool()
        self._retired: list[TapRows] = []  # buffers of collected requests, for _forget_stale
        self._plan_of: RowIndex | None = None  # the row index _plan was made from
        self._waiters: dict[tuple[str, int], _Waiter] = {}  # chunks awaiting their rows
        # Per request: (key, first row, end row); every row's position and token id.
        self._plan: tuple[list[tuple[tuple[str, int], int, int]], list[int], list[int]] = (
            [],
            [],
            [],
        )
        super().__init__(addresses)

    def subscription(self) -> Subscription:
        return Subscription(policy="block", returned_only=True, name="actbus-return")

    # ------------------------------------------------------------- front end side
    def expect(
        self,
        request_id: str,
        n: int,
        sel: Selection,
        prompt_len: int,
        max_tokens: int | None = None,
        *,
        index: int = 0,
        chunked: bool = False,
    ) -> None:
        """Register samples ``index .. index + n - 1`` of a request before it is queued;
        ``max_tokens`` (its token budget) sizes their buffers, so most never grow. The
        front end registers each sample under vLLM's own id of it (unique where caller
        ids repeat), which the worker publishes in ``RowIndex.engine_ids``. ``chunked``:
        its rows go out by its SSE chunks (``Due``, ``rows_for``)."""
        budget = prompt_len + (max_tokens if max_tokens else CAPACITY_GUESS) - 1
        rows = _expected_rows(sel, prompt_len, min(budget, prompt_len + CAPACITY_CAP))
        capacity = 1 if rows is None else rows
        with self._cond:
            for i in range(index, index + n):
                self._drop((request_id, i))  # an id used again: the old one is gone
                self._pending[(request_id, i)] = _Pending(sel, prompt_len, capacity, chunked)
            self._own(request_id)

    def take(
        self,
        request_id: str,
        index: int,
        num_generated: int,
        *,
        final: bool,
        delta: bool,
        ends_follow: bool = True,
        wait: bool = True,
    ) -> Activations | Due | None:
        """The rows for an output with ``num_generated`` tokens so far: views of the
        request's buffers, made in constant time under the lock (the receiving thread
        is never held up by an output being made).

        ``ends_follow`` is False when the front end itself ended the request (a stop
        string): the engine learns of it only after this output is made, so the
        request's end cannot come first and is not waited for. ``wait`` is False for
        an abort: nobody reads its rows, and they may never come (a request still
        queued was never computed), so its final output takes what is there at once,
        and the engine hears of the abort without delay.

        A ``chunked`` sample's output gets a ``Due`` instead, made at once: its chunk
        takes the rows, and waits for them off vLLM's output processing.
        """
        key = (request_id, index)
        with self._cond:
            p = self._pending.get(key)
            if p is None:
                return None
            limit = p.prompt_len + num_generated - 1  # positions fed so far
            if p.chunked:
                return Due(self, key, limit, final, ends_follow)
            want = None
            if final:
                want = _expected_rows(p.sel, p.prompt_len, limit)
                bound = RETURN_TIMEOUT_S if wait and (want is not None or ends_follow) else 0.0
                self._wait_final(lambda: self._arrived(p, limit, want), bound)
                self._drop(key)
                self._disown_if_done(request_id)
                if not self._pending:  # idle: keep no slab alive for requests to come
                    self._slabs.release()
            acts = self._hand_out(p, limit, delta)
            if final:
                acts.complete = self._arrived(p, limit, want)
        if final and not acts.complete and wait:
            log.warning(
                "actbus: request %s sample %d: %d of %s rows arrived before its final output",
                request_id, index, len(acts.positions), want,
            )  # fmt: skip
        return acts

    def _hand_out(self, p: _Pending, limit: int, delta: bool) -> Activations:
        """Rows below ``limit`` present at every tap, in position order: those not
        handed out yet (DELTA, which marks them handed out) or all (CUMULATIVE)."""
        taps = [p.taps.get(k) for k in p.sel.keys]
        n = min((t.pending_below(limit) if t else 0) for t in taps) if taps else 0
        tensors = {}
        positions = token_ids = _NO_IDS
        for k, t in zip(p.sel.keys, taps, strict=True):
            if t is None:
                tensors[k] = self._empty_rows()
                continue
            # CUMULATIVE outputs never move ``start``: it stays 0, and they get all rows.
            positions, token_ids, tensors[k] = t.view(t.start, t.start + n)
            if delta:
                t.start += n
        return Activations(positions, token_ids, tensors, complete=False)

    def _empty_rows(self) -> torch.Tensor:
        info = self._sub.welcome or {}
        dtype = DTYPES.get(info.get("dtype", "float32"), torch.float32)
        return torch.empty((0, int(info.get("hidden_size", 0))), dtype=dtype)

    async def rows_for(self, due: Due, bound: float) -> tuple[Activations | None, float]:
        """The rows of the chunk made from ``due``'s output: those below its limit not
        handed out yet, once all have arrived or ``bound`` seconds passed (a final
        chunk: up to ``RETURN_TIMEOUT_S``, while rows keep coming, and it lets the
        sample go). Awaited on the running loop, which it never blocks: the receiving
        thread wakes it, and a sample dropped meanwhile (an abort) ends the wait at
        once. Returns the rows (None: the sample is gone) and the seconds waited."""
        key, limit = due.key, due.limit
        with self._cond:
            p = self._pending.get(key)
            if p is None:
                return None, 0.0
            want = _expected_rows(p.sel, p.prompt_len, limit)
        if due.final:
            bound = RETURN_TIMEOUT_S if want is not None or due.ends_follow else 0.0
        elif want is None:  # "last": its one row comes with the end
            bound = 0.0
        waited = await self._until(key, limit, want, min(bound, RETURN_TIMEOUT_S), due.final)
        with self._cond:
            p = self._pending.get(key)
            if p is None:
                return None, waited
            acts = self._hand_out(p, limit, delta=True)
            if due.final:
                acts.complete = self._arrived(p, limit, want)
                self._drop(key)
                self._disown_if_done(key[0])
                if not self._pending:
                    self._slabs.release()
            elif want is not None:
                taps = (p.taps.get(k) for k in p.sel.keys)
                handed = min((t.released + t.start if t else 0) for t in taps)
                acts.late = max(want - handed, 0)
        if due.final and not acts.complete:
            log.warning(
                "actbus: request %s sample %d: %d of %s rows arrived before its last chunk",
                key[0], key[1], len(acts.positions), want,
            )  # fmt: skip
        return acts, waited

    def release(self, key: tuple[str, int]) -> None:
        """Let a ``chunked`` sample go whose stream ended before its final chunk."""
        with self._cond:
            if key in self._pending:
                self._drop(key)
                self._disown_if_done(key[0])

    async def _until(
        self, key: tuple[str, int], limit: int, want: int | None, bound: float, final: bool
    ) -> float:
        """Await, at most ``bound`` s (``final``: and while rows keep coming, as
        ``_wait_final``), until every tap of ``key`` has its rows below ``limit``;
        the seconds waited. One waiter per sample: its stream's current chunk."""
        if bound <= 0:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        ok = waited = False
        try:
            while True:
                with self._cond:
                    p = self._pending.get(key)
                    short = set() if p is None else self._short(p, limit, want)
                    if not short:
                        ok = p is not None
                        break
                    w = _Waiter(limit, want, short, loop, loop.create_future())
                    self._waiters[key] = w
                now = time.monotonic()
                left = t0 + bound - now
                if final:
                    left = min(left, STALL_S - (now - max(self._received_at, t0)))
                if left <= 0:
                    break
                waited = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.future, left)
        finally:
            with self._cond:
                self._waiters.pop(key, None)
        took = time.monotonic() - t0 if waited else 0.0
        if waited and final:
            with self._cond:
                self._count_wait(took, ok)
        return took

    @staticmethod
    def _short(p: _Pending, limit: int, want: int | None) -> set[tuple[int, str]]:
        """The taps of ``p`` whose rows below ``limit`` have not all come."""
        return {
            k
            for k in p.sel.keys
            if k not in p.ended_taps
            and (want is None or ((t := p.taps.get(k)) is None or t.below(limit) < want))
        }

    def _wake(self, tap: tuple[int, str]) -> None:
        """Under the lock, after a message of ``tap`` was filed: resolve the waiters
        that now have every tap's rows, or whose sample is gone."""
        for key, w in list(self._waiters.items()):
            p = self._pending.get(key)
            if p is not None and tap in w.short:
                t = p.taps.get(tap)
                if tap in p.ended_taps or (
                    w.want is not None and t is not None and t.below(w.limit) >= w.want
                ):
                    w.short.discard(tap)
            if p is None or not w.short:
                del self._waiters[key]
                _resolve(w)

    @staticmethod
    def _arrived(p: _Pending, limit: int, want: int | None) -> bool:
        """Every tap has its rows: as many as expected, or the request's end came on
        that tap's stream (messages of one tap arrive in order; ``last`` rows come
        with the end)."""
        return not ReturnCollector._short(p, limit, want)

    # ------------------------------------------------------------- receiving side
    def _add(self, b: Batch) -> None:
        """Copy each pending request's rows into its buffers; one message's work is
        one pass over its requests, with the index decoded once per step. The single
        rows of a decode step are only noted in that pass, then written with one
        scatter per slab (``batched``); pieces of several rows are slice copies."""
        rows, tap = b.header.rows, (b.layer, b.hook)
        if rows is not self._plan_of:  # the taps of one step share one row index
            self._plan_of = rows
            offsets = rows.offsets.tolist()
            ids = rows.keys()  # vLLM's own ids: caller ids may repeat
            keys = zip(ids, rows.sample_index or [0] * len(ids), strict=True)
            self._plan = (
                list(zip(keys, offsets, offsets[1:], strict=False)),  # offsets: one more
                rows.positions.tolist(),
                rows.token_ids.tolist(),
            )
        spans, positions, token_ids = self._plan
        data = b.tensor.view(torch.uint8).numpy() if b.tensor.numel() else None
        dtype, width = DTYPES[b.header.dtype], b.header.shape[1]
        batched = self.batched
        with self._cond:
            pending = self._pending
            scatter: dict[Slab, tuple[list[int], list[int]]] = {}
            slab = src = dst = None  # the slab of the last row noted, and its lists
            for key, lo, hi in spans if data is not None else ():
                p = pending.get(key)
                if p is None or lo == hi:
                    continue  # another front end's request, or one already collected
                t = p.taps.get(tap)
                if t is None:
                    t = p.taps[tap] = self._buffer(data.shape[1], dtype, width, p.capacity)
                if hi - lo > 1:
                    t.append(rows.positions[lo:hi], rows.token_ids[lo:hi], data[lo:hi])
                    continue
                home, end, position = t.home, t.end, positions[lo]
                if (
                    batched
                    and home is not None
                    and end < home[2]
                    and (end == t.start or position >= t.last)
                ):  # room, in order: the row's place is known now, written below
                    if home[0] is not slab:
                        slab = home[0]
                        src, dst = scatter.setdefault(slab, ([], []))
                    src.append(lo)
                    dst.append(home[1] + end)
                    t.end, t.last = end + 1, position
                else:
                    t.append_one(position, token_ids[lo], data[lo])
            items = as_items(data) if scatter else None
            for slab, (src, dst) in scatter.items():  # numpy lets go of the GIL to copy
                d = np.asarray(dst, dtype=np.intp)
                # Rows in a run (the usual case) are read in place, not gathered first.
                s = slice(src[0], src[-1] + 1) if src[-1] - src[0] == len(src) - 1 else src
                slab.items[d] = items[s]
                slab.pos[d] = rows.positions[s]
                slab.tok[d] = rows.token_ids[s]
            now = time.monotonic()
            for end in b.header.ended:
                p = pending.get((end.key, end.sample_index))
                if p is not None:
                    p.ended_taps.add(tap)
                    if p.ended is None:
                        p.ended, p.ended_at = end.reason, now
            if self._waiters:
                self._wake(tap)
            self._cond.notify_all()

    def _buffer(self, row_bytes: int, dtype: torch.dtype, width: int, capacity: int) -> TapRows:
        if self.batched:
            return TapRows.over(self._slabs, row_bytes, dtype, width, capacity)
        return TapRows(row_bytes, dtype, width, capacity)

    def _drop(self, key: tuple[str, int]) -> None:
        p = self._pending.pop(key, None)
        if p is not None:
            self._retired.extend(p.taps.values())
        w = self._waiters.pop(key, None)
        if w is not None:  # its chunk waits no longer: the sample is gone
            _resolve(w)

    def close(self) -> None:
        with self._cond:
            waiters, self._waiters = list(self._waiters.values()), {}
        for w in waiters:
            _resolve(w)
        super().close()

    def _housekeep(self, dropped: bool) -> None:
        """Let the slabs that collected requests left sparse go (on this thread: it
        may copy)."""
        if dropped and not self._pending:
            self._slabs.release()
        retired, self._retired = self._retired, []
        retire(retired, self._slabs)


def _resolve(w: _Waiter) -> None:
    """Wake a waiting chunk, from any thread (its loop may be gone: then nobody waits)."""

    def done() -> None:
        if not w.future.done():
            w.future.set_result(None)

    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
        w.loop.call_soon_threadsafe(done)


def _expected_rows(sel: Selection, prompt_len: int, limit: int) -> int | None:
    """Rows per tap that positions ``0 .. limit-1`` give under ``sel`` (None: ``last``,
    whose one row comes with the request's end), by the worker's own row mask."""
    if sel.positions == "last":
        return None
    mask = sel.row_mask(np.arange(limit), prompt_len)
    return limit if mask is None else int(mask.sum())


_NO_IDS = torch.zeros(0, dtype=torch.int64)


_REGISTRY = ReturnCollector.registry
_COLLECTORS = _REGISTRY.collectors
_OWNER = _REGISTRY.owner
"""Request id (vLLM's own) -> the collector holding its rows, for the output processor's wrapper."""


def collector_for(request_id: str) -> ReturnCollector | None:
    return _REGISTRY.collector_for(request_id)


def close_collectors(addresses: list[str]) -> int:
    """Close the collectors that read any of these publishers, whose engine stopped
    (see ``Registry.close``). Returns how many were closed."""
    return _REGISTRY.close(addresses)


def forget(request_ids: list[str]) -> None:
    """Drop the rows of requests whose caller went away (an abort)."""
    _REGISTRY.forget(request_ids)
