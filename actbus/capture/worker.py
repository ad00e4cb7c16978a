"""The capture worker: after each engine step, turn tap buffers into messages.

It lives in the vLLM worker process (tensor-parallel rank 0 only: the residual
stream is replicated across TP ranks). Runner adapters call ``on_step`` with a
``StepView`` built from the runner's own batch, so rows map to requests exactly
as the model saw them under continuous batching and chunked prefill.

Per request it keeps the selection and a watermark, the next position not yet
published: a request preempted and recomputed from scratch re-runs positions
it already published, and those rows are skipped, so every position goes out
exactly once. Selected rows are gathered on the device, so only they are copied,
and only for taps the bus admits (``Outlet.admit``): a tap no subscriber wants,
or one whose every subscriber is lossy and would drop it now, costs no copy at all.
Taps that publish the same rows share one row index and one host transfer.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from actbus.bus.outlet import Admission, Outlet, TapOffer
from actbus.bus.publisher import Publisher
from actbus.capture.selection import Selection
from actbus.capture.stages import StageForwarder, StageInbox, stage_address
from actbus.capture.taps import TapSet
from actbus.config import CaptureConfig
from actbus.errors import VllmVersionError
from actbus.request_ids import caller_request_id
from actbus.steps import StepGuard, StepHarvest, StepRequests, StepView
from actbus.wire import DTYPE_NAMES, Header, RequestEnd, RowIndex

log = logging.getLogger("actbus.capture")
# Under vLLM's own logger, so the line saying what is published where reaches the
# server's log (vLLM configures only its own loggers' output).
_serving_log = logging.getLogger("vllm.actbus")
_CHILD = re.compile(r"^(\d+)_")
# Tests set this to check every step's layout (``StepGuard``), not only the first ones.
_CHECK = os.environ.get("ACTBUS_CHECK_POSITIONS", "") not in ("", "0")
# Largest device tensor staged for one host copy (several taps share one when small).
STAGE_BYTES = 256 << 20


@dataclass
class _Request:
    caller_id: str
    sample_index: int
    prompt_len: int
    sel: Selection
    sig: tuple  # what decides its rows: (layers, hooks, positions)
    next_pos: int = 0
    last: dict | None = None  # positions="last": the newest row, held until the end
    live: dict[str, int] = field(default_factory=dict)  # live steering vector -> version
    engine_id: str = ""  # vLLM's own id, for a request whose caller gets its rows back


@dataclass
class _Part:
    """Rows of some requests for one tap, in request order (taps with the same
    requests share one)."""

    entries: list[tuple[_Request, np.ndarray]] = field(default_factory=list)  # positions
    index: list[np.ndarray | None] = field(default_factory=list)  # step rows; None: held

    @property
    def num_rows(self) -> int:
        return sum(len(pos) for _, pos in self.entries)

    @property
    def held(self) -> list[_Request]:
        """Requests whose row was kept on the device since an earlier step (``last``)."""
        return [st for (st, _), ix in zip(self.entries, self.index, strict=True) if ix is None]

    @property
    def returning(self) -> bool:
        """Whether some of these rows go back to their caller too."""
        return any(st.sel.returns for st, _ in self.entries)


class _Whole:
    """Every row of the step, of every request (the fast path), in the shape of a
    ``_Part``: the per-request lists are made only if something asks for them (a
    request ending with ``positions="last"`` in the same step); the row index is made
    from the step's arrays directly. Built every step on the engine's own thread, even
    when no subscriber takes the step, so it does no per-request work it can skip."""

    def __init__(self, states: list[_Request], offsets: np.ndarray, host_pos: np.ndarray):
        self.states = states
        self.offsets = offsets
        self.host_pos = host_pos
        self.held: list[_Request] = []

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    @cached_property
    def returning(self) -> bool:
        return any(st.sel.returns for st in self.states)

    @property
    def entries(self) -> list[tuple[_Request, np.ndarray]]:
        o, pos = self.offsets.tolist(), self.host_pos
        return [(st, pos[o[i] : o[i + 1]]) for i, st in enumerate(self.states)]

    @property
    def index(self) -> list[np.ndarray | None]:
        o = self.offsets.tolist()
        return [np.arange(o[i], o[i + 1]) for i in range(len(self.states))]

    def row_index(self, toks: torch.Tensor) -> RowIndex:
        return _index(self.states, self.offsets - self.offsets[0], self.host_pos, toks)


class CaptureWorker:
    """Owns the taps and the publisher for one engine."""

    def __init__(
        self,
        cfg: CaptureConfig,
        taps: TapSet,
        model_name: str,
        engine: dict[str, str] | None = None,
        *,
        layers: tuple[int, ...] | None = None,
        stage: tuple[int, int] = (0, 1),
        dp: tuple[int, int] = (0, 1),
        monitors: dict[str, dict] | None = None,
    ) -> None:
        """``layers``: every layer captured, on all pipeline stages (default: the
        taps'); ``stage``: (pipeline rank, pipeline size). The first stage publishes,
        the others forward their taps' messages to it. ``dp``: (data-parallel rank,
        size): the rank picks the address from ``cfg.publish`` and is part of the
        publisher's identity in its WELCOME. ``monitors``: what the publisher tells
        subscribers of the engine's monitors (name -> layers, hook, width, labels)."""
        self.cfg = cfg
        self.taps = taps
        self.model_name = model_name
        self.step = 0
        self._side = None  # CUDA side stream for device-to-host copies, made on first use
        self._reqs: dict[str, _Request] = {}
        self._no_tokens = torch.zeros(0, dtype=torch.int64, device=taps.device)
        layers = tuple(sorted(layers if layers is not None else {k[0] for k in taps.keys}))
        self._full_sig = (layers, tuple(cfg.hooks), "all")
        self._stages = None
        self.guard = StepGuard(always=_CHECK, version=(engine or {}).get("vllm", "unknown"))
        self.stopped: str | None = None
        """Why capture stopped (an invariant broke), or None while it runs."""
        self.invariant_failures = 0
        self.harvests: list[StepHarvest] = []
        """What publishes beside capture after each step, on the same rows (the
        engine adds the monitors' harvest, ``actbus.monitor.worker``)."""
        self.live_versions: Callable[[str], dict[str, int]] | None = None
        """Which live vector versions a request steers with, for its rows' index (the
        engine sets it to this rank's steerer's)."""
        self.publisher: Outlet
        address = cfg.publish_address(dp[0])
        if stage[0] > 0:
            self.publisher = StageForwarder(stage_address(address))
            atexit.register(self.close)  # flushes what is still queued for the first stage
            log.info("actbus: pipeline stage %d forwards layers %s", stage[0], taps.keys)
            return
        self.publisher = Publisher(
            address,
            info={
                "model": model_name,
                "hidden_size": taps.hidden_size,
                "dtype": DTYPE_NAMES[taps.dtype],
                "layers": list(layers),
                "hooks": sorted(cfg.hooks),
                "requests": cfg.requests,
                "engine": engine or {},
                "pipeline_stages": stage[1],
                **(
                    {"router": {"num_experts": taps.experts[0], "top_k": taps.experts[1]}}
                    if taps.experts
                    else {}
                ),
                "dp_rank": dp[0],
                "dp_size": dp[1],
                **({"monitors": monitors} if monitors else {}),
            },
            queue_bytes=cfg.queue_mb << 20,
            heartbeat_s=cfg.heartbeat_s,
            subscriber_timeout_s=cfg.subscriber_timeout_s,
            server_secret_key=cfg.server_secret_key,
            authorized_keys=cfg.authorized_keys,
            insecure_allow_any_interface=cfg.insecure_allow_any_interface,
            max_window_mb=cfg.max_window_mb,
            max_subscribers=cfg.max_subscribers,
            shm_mb=cfg.shm_mb,
        )
        if stage[1] > 1:
            self._stages = StageInbox(self.publisher, stage_address(address))
        atexit.register(self.close)
        _serving_log.info(
            "actbus: capturing layers %s hooks %s of %s (hidden size %d), publishing on %s",
            list(layers),
            list(cfg.hooks),
            model_name,
            taps.hidden_size,
            address if dp[1] == 1 else f"{address} (data-parallel rank {dp[0]} of {dp[1]})",
        )

    # ------------------------------------------------------------------ requests
    def _admit(self, sr: StepRequests) -> None:
        for rid, prompt_len, wire in sr.new:
            if rid in self._reqs:  # resumed after preemption: keep the watermark
                self._reqs[rid].prompt_len = prompt_len
                continue
            if wire is None or "layers" not in wire:
                continue  # not captured (maybe steered only): costs only the in-graph copy
            sel = Selection.from_wire(wire)
            child = _CHILD.match(rid) if int(wire.get("n", 1)) > 1 else None
            self._reqs[rid] = _Request(
                caller_id=str(wire.get("caller_id") or caller_request_id(rid)),
                sample_index=int(child.group(1)) if child else 0,
                prompt_len=prompt_len,
                sel=sel,
                sig=(sel.layers, sel.hooks, sel.positions),
                live=self.live_versions(rid) if self.live_versions is not None else {},
                engine_id=rid if sel.returns else "",
            )

    def _retire(self, sr: StepRequests) -> tuple[list[RequestEnd], list[_Request]]:
        ended, lasts = [], []
        for rid in sr.finished:
            st = self._reqs.pop(rid, None)
            if st is None:
                continue
            ended.append(
                RequestEnd(
                    st.caller_id, st.sample_index, sr.reasons.get(rid, "unknown"), st.engine_id
                )
            )
            if st.last is not None:
                lasts.append(st)
        return ended, lasts

    # ---------------------------------------------------------------------- step
    def on_step(self, view: StepView) -> None:
        """Publish one step's rows; a broken invariant stops capture, not the engine."""
        if self.stopped is not None:
            return
        try:
            self._step(view)
        except VllmVersionError as e:
            self.fail(e)

    def fail(self, error: VllmVersionError) -> None:
        """A runner no longer matches what actbus reads: log it, count it, stop capture
        (the publisher closes, so subscribers see the stream end). Generation goes on."""
        self.invariant_failures += 1
        if self.stopped is not None:
            return
        self.stopped = str(error)
        log.error(
            "%s. Capture is stopped for the rest of this engine's life (invariant "
            "failures: %d); generation goes on without it.",
            error,
            self.invariant_failures,
        )
        self.close()

    def _step(self, view: StepView) -> None:
        started = view.started if view.started is not None else time.perf_counter()
        sr = view.requests
        self._admit(sr)
        ended, lasts = self._retire(sr)
        n = view.num_tokens
        if n == 0:
            view.token_ids = self._no_tokens
        if n > self.taps.max_rows:
            raise RuntimeError(
                f"actbus: step has {n} tokens but tap buffers hold {self.taps.max_rows}"
            )
        positions = self.guard.check(view)
        parts, full, host_pos = self._plan(view) if n else ({}, False, None)
        if positions:
            self.guard.check_positions(view, host_pos)
        if parts or ended or lasts:
            self._emit(view, parts, full, host_pos, ended, lasts)
        for harvest in self.harvests:  # same rows, same positions as capture's
            harvest.step(
                self.step,
                view.req_ids,
                np.asarray(view.offsets, dtype=np.int64),
                host_pos,
                view.token_ids,
                sr,
                self.publisher,
                self._host_copies,
            )
        # Every engine step counts, captured or not, so all pipeline stages agree.
        self.publisher.count_step(n, time.perf_counter() - started)
        self.step += 1

    def _plan(self, view: StepView) -> tuple[dict, bool, np.ndarray]:
        """Which rows each tap publishes this step, from host-side facts only."""
        sr = view.requests
        offsets = np.asarray(view.offsets, dtype=np.int64)
        counts = np.diff(offsets)
        starts = np.fromiter(
            (sr.starts.get(r, 0) for r in view.req_ids), dtype=np.int64, count=len(view.req_ids)
        )
        # Positions run on within a request: start, start+1, ... (no speculative tokens).
        host_pos = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1])
        states = [self._reqs.get(r) for r in view.req_ids]
        full_sig = self._full_sig
        fast = all(
            st is not None and st.sig == full_sig and st.next_pos <= s
            for st, s in zip(states, starts.tolist(), strict=True)
        )
        if fast:  # every request wants every tap at every position: no gather
            for st, end in zip(states, (starts + counts).tolist(), strict=True):
                st.next_pos = end
            whole = _Whole(states, offsets, host_pos)
            return {key: whole for key in self.taps.keys}, True, host_pos
        parts: dict[tuple[int, str], _Part] = {}
        for i, st in enumerate(states):
            if st is None or counts[i] == 0:
                continue
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            pos = host_pos[lo:hi]
            keep = pos >= st.next_pos  # recomputed after preemption: already published
            st.next_pos = max(st.next_pos, int(pos[-1]) + 1)
            if not keep.any():
                continue
            if st.sel.positions == "last":
                row = lo + int(np.flatnonzero(keep)[-1])
                self._hold_last(st, view, row, int(host_pos[row]))
                continue
            mask = st.sel.row_mask(pos, st.prompt_len)
            if mask is not None:
                keep &= mask
                if not keep.any():
                    continue
            rows = np.flatnonzero(keep) + lo
            for key in st.sel.keys:
                p = parts.setdefault(key, _Part())
                p.entries.append((st, pos[keep]))
                p.index.append(rows)
        # Taps with the same requests have the same rows: one part, one copy for all.
        shared: dict[tuple[int, ...], _Part] = {}
        for key, p in parts.items():
            parts[key] = shared.setdefault(tuple(id(st) for st, _ in p.entries), p)
        return parts, False, host_pos

    def _hold_last(self, st: _Request, view: StepView, row: int, pos: int) -> None:
        """Keep a device copy of a ``last`` request's newest row until it ends."""
        bufs = self.taps.buffers
        st.last = {
            "pos": pos,
            "acts": {k: bufs[k][row : row + 1].clone() for k in st.sel.keys if k in bufs},
            "token": view.token_ids[row : row + 1].clone(),
        }

    def _emit(self, view, parts, full, host_pos, ended, lasts) -> None:
        n = view.num_tokens
        tok = view.token_ids[:n]
        # Rows of requests that ended with positions="last".
        for st in lasts:
            for key in st.sel.keys:
                old = parts.get(key, _Part())
                p = parts[key] = _Part(list(old.entries), list(old.index))  # parts share
                p.entries.append((st, np.array([st.last["pos"]], dtype=np.int64)))
                p.index.append(None)  # marks a held row
        pub, ts = self.publisher, self.taps
        none = _Part()
        taps = [(k, parts.get(k, none)) for k in ts.keys if k in parts or ended]
        offers = [
            TapOffer(
                k[0],
                k[1],
                p.num_rows * ts.width(k) * ts.dtype_of(k).itemsize,
                bool(ended) or p.returning,
            )
            for k, p in taps
        ]
        # Taps sharing rows, and row width and dtype (the router's differ), share a copy.
        groups: dict[tuple, tuple[_Part, list[tuple[int, str]]]] = {}
        for (key, p), verdict in zip(taps, pub.admit(self.step, offers), strict=True):
            if verdict is Admission.SEND:
                kind = (id(p), ts.width(key), ts.dtype_of(key))
                groups.setdefault(kind, (p, []))[1].append(key)
            elif verdict is Admission.DROP:  # no copy: counted as a drop by the bus
                pub.drop(self._header(key, (p.num_rows, ts.width(key)), RowIndex.empty(), ended))
        whole = full and not lasts
        for p, keys in groups.values():
            width = ts.width(keys[0])
            row_bytes = width * ts.dtype_of(keys[0]).itemsize
            shape = (p.num_rows, width)
            idx, toks = self._rows(p, tok, whole=whole)  # once for every tap of the group
            # Staged in tensors of at most STAGE_BYTES: one block per step for every
            # tap would need GiBs of contiguous device memory next to the KV cache.
            per = max(1, STAGE_BYTES // max(1, shape[0] * row_bytes))
            rows = None
            for lo in range(0, len(keys), per):
                chunk = keys[lo : lo + per]
                acts = self._collect(chunk, p, idx, n, whole=whole)
                ready = None
                if self._no_tokens.is_cuda and rows is None:  # token ids go with chunk one
                    (acts, toks), ready = self._to_host_async([acts, toks])
                elif self._no_tokens.is_cuda:
                    (acts,), ready = self._to_host_async([acts])
                if rows is None:
                    rows = _row_index(p, toks)  # one index for every tap of the group
                for i, key in enumerate(chunk):
                    pub.publish(self._header(key, shape, rows, ended), acts[i], ready=ready)

    def _header(self, key, shape, rows: RowIndex, ended) -> Header:
        return Header(
            step=self.step,
            layer=key[0],
            hook=key[1],
            dtype=DTYPE_NAMES[self.taps.dtype_of(key)],
            shape=shape,
            model=self.model_name,
            rows=rows,
            ended=ended,
        )

    def _rows(
        self, p: _Part, tok: torch.Tensor, *, whole: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The device index of ``p``'s rows in this step (None: every row, or none)
        and fresh ``[rows]`` token ids, held rows last."""
        if whole:
            return None, tok.clone()
        step_rows = [ix for ix in p.index if ix is not None]
        idx = None
        tok_parts = []
        if step_rows:
            idx = torch.from_numpy(np.concatenate(step_rows)).to(tok.device, non_blocking=True)
            tok_parts.append(tok.index_select(0, idx))
        tok_parts += [st.last["token"] for st in p.held]
        return idx, (torch.cat(tok_parts) if tok_parts else tok[:0].clone())

    def _collect(
        self, keys: list[tuple[int, str]], p: _Part, idx, n: int, *, whole: bool
    ) -> torch.Tensor:
        """Fresh ``[len(keys), rows, hidden]`` activations, rows as ``_rows`` orders them.

        Fresh (copies or gathers on the compute stream), so the tap buffers are free
        for the next step in stream order. One tensor for several taps, so the host
        copy is one transfer.
        """
        bufs = [self.taps.buffers[k] for k in keys]
        held = p.held
        m = n if whole else (0 if idx is None else len(idx))
        shape = (len(keys), m + (0 if whole else len(held)), bufs[0].shape[1])
        # On CPU the rows are gathered straight into the memory local subscribers
        # read (the publisher's shared region), so they are copied once, here.
        acts = None if bufs[0].is_cuda else self.publisher.host_tensor(shape, bufs[0].dtype)
        if whole:  # every row of every tap: one stacking copy
            if acts is None:
                return torch.stack([b[:n] for b in bufs])
            return torch.stack([b[:n] for b in bufs], out=acts)
        if acts is None:
            acts = bufs[0].new_empty(shape)
        if idx is not None:
            for i, b in enumerate(bufs):
                torch.index_select(b, 0, idx, out=acts[i, :m])
        for j, st in enumerate(held):  # rows kept on the device since their step
            for i, key in enumerate(keys):
                acts[i, m + j] = st.last["acts"][key][0]
        return acts

    def _host_copies(self, tensors: list[torch.Tensor]):
        """Fresh tensors on the host: copied asynchronously on CUDA (with the event to
        wait on), as they are on CPU."""
        if self._no_tokens.is_cuda:
            return self._to_host_async(tensors)
        return tensors, None

    def _to_host_async(self, tensors: list[torch.Tensor]):
        """Host copies that neither stall the engine nor slow its next step.

        ``tensors`` are fresh device tensors (copies or gathers made on the compute
        stream, so the tap buffers are free for the next forward in stream order);
        the device-to-host copy into pinned memory (the publisher's shared region when
        subscribers on this host read it) runs on a side stream, overlapping
        the next step. Returns the host tensors and an event the publisher thread
        waits on before reading them.
        """
        main = torch.cuda.current_stream()
        staged = tensors
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(main)
        hosts = []
        with torch.cuda.stream(self._side):
            for t in staged:
                # Into the shared region local subscribers read (pinned), else torch's
                # pinned cache.
                h = self.publisher.host_tensor(tuple(t.shape), t.dtype)
                if h is None:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(self._side)  # keep the staging memory until copied
                hosts.append(h)
            # Blocking: the publisher thread sleeps while it waits for the copy,
            # instead of spinning a core the engine's processes may need.
            ready = torch.cuda.Event(blocking=True)
            ready.record(self._side)
        return hosts, ready

    def close(self) -> None:
        if self._stages is not None:
            self._stages.close()
        self.publisher.close()


def _row_index(p: _Part | _Whole, toks: torch.Tensor) -> RowIndex:
    if isinstance(p, _Whole):
        return p.row_index(toks)
    counts = [len(pos) for _, pos in p.entries]
    positions = (
        np.concatenate([pos for _, pos in p.entries]) if p.entries else np.zeros(0, dtype=np.int64)
    )
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
    return _index([st for st, _ in p.entries], offsets, positions, toks)


def _index(
    states: list[_Request], offsets: np.ndarray, positions: np.ndarray, toks: torch.Tensor
) -> RowIndex:
    """The row index of ``states``' rows (``offsets`` from 0): what each request says
    of itself, in one place for the fast path and the gathered one."""
    returned = [st.sel.returns for st in states]
    live = [st.live for st in states]
    engine_ids = [st.engine_id for st in states] if any(returned) else []
    return RowIndex(
        request_ids=[st.caller_id for st in states],
        offsets=offsets,
        positions=positions,
        token_ids=toks.numpy(),
        sample_index=[st.sample_index for st in states],
        tags=[st.sel.tags for st in states],
        returned=returned if any(returned) else [],
        steer_versions=live if any(live) else [],
        engine_ids=engine_ids,
    )
