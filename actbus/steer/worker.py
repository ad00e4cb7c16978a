"""Worker side of steering: the per-token tables filled before each forward.

Runs on every rank (tensor-parallel ranks each add the same vector to their copy of
the stream; a pipeline stage steers the layers it owns). Requests arrive with their
steering resolved (``actbus.steer.frontend``): vectors by digest with their values,
entries as (layer, hook, digest, a, b, tier, positions). A vector gets a row of the
device table while some request in flight uses it (rows are shared by digest and
counted); ``fill`` writes each steered point's indices and coefficients for this
step's tokens, and zeroes a point's buffers once no token is steered there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from actbus.capture.scheduler import StepRequests
from actbus.steer.graph import SteerTables

log = logging.getLogger("actbus.steer")


class _Upload:
    """Host-to-device copies that do not stall the host on CUDA.

    A copy from pageable memory waits for the stream to drain, which would undo vLLM's
    overlap of input preparation with the previous forward. Each copy goes through a
    fresh pinned tensor, kept (with an event) until the copy has run; copies stay in
    stream order, so the forward that follows reads the new values. On CPU: a copy."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._inflight: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        self._inflight = [(t, e) for t, e in self._inflight if not e.query()]
        host = src.pin_memory()
        dst.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._inflight.append((host, done))


@dataclass(frozen=True)
class _Entry:
    point: tuple[int, str]
    slot: int
    a: float
    b: float
    tier: str
    positions: str | tuple[int, ...]

    def steers(self, pos: int, prompt_len: int) -> bool:
        """Whether this entry steers the token at ``pos`` (a decode step's one token)."""
        if (self.tier == "prefill" and pos >= prompt_len) or (
            self.tier == "decode" and pos < prompt_len
        ):
            return False
        p = self.positions
        if p == "all":
            return True
        if p == "prompt":
            return pos < prompt_len
        if p == "generated":
            return pos >= prompt_len
        if p == "last_prompt":
            return pos == prompt_len - 1
        return pos in p

    def mask(self, pos: np.ndarray, prompt_len: int) -> np.ndarray:
        """Which of the tokens at ``pos`` this entry steers."""
        if self.tier == "prefill":
            m = pos < prompt_len
        elif self.tier == "decode":
            m = pos >= prompt_len
        else:
            m = np.ones(len(pos), dtype=bool)
        p = self.positions
        if p == "prompt":
            m &= pos < prompt_len
        elif p == "generated":
            m &= pos >= prompt_len
        elif p == "last_prompt":
            m &= pos == prompt_len - 1
        elif isinstance(p, tuple):
            m &= np.isin(pos, np.asarray(p, dtype=np.int64))
        return m


@dataclass
class _Request:
    prompt_len: int
    entries: list[_Entry]
    digests: list[str]


class Steerer:
    """Owns a model's steering tables on one rank."""

    def __init__(self, tables: SteerTables) -> None:
        self.tables = tables
        self.dtype = tables.table.dtype
        self._rows: dict[str, list[int]] = {}  # digest -> [table row, requests using it]
        self._free = list(range(tables.table.shape[0] - 1, 0, -1))  # row 0 stays zero
        self._reqs: dict[str, _Request] = {}
        self._dirty: set[tuple[int, str]] = set()
        self.skipped = 0  # requests not steered because the table was full
        self._upload = _Upload(tables.table.device)

    # ------------------------------------------------------------------ requests
    def admit(self, sr: StepRequests) -> None:
        """Take in new requests' steering and free what ended requests held."""
        for rid in sr.finished:
            st = self._reqs.pop(rid, None)
            if st is not None:
                self._release(st.digests)
        for rid, prompt_len, wire in sr.new:
            if rid in self._reqs:  # resumed after preemption
                continue
            steer = wire.get("steer") if wire else None
            if steer:
                st = self._take(rid, prompt_len, steer)
                if st is not None:
                    self._reqs[rid] = st

    def _take(self, rid: str, prompt_len: int, steer: dict) -> _Request | None:
        vectors: dict[str, bytes] = steer["vectors"]
        need = [d for d in vectors if d not in self._rows]
        if len(need) > len(self._free):
            self.skipped += 1
            log.error(
                "actbus: request %s is NOT steered: the steering table is full (%d rows in "
                "use); raise actbus.steer.max_vectors",
                rid, len(self._rows),
            )  # fmt: skip
            return None
        for d in vectors:
            if d in self._rows:
                self._rows[d][1] += 1
                continue
            row = self._free.pop()
            values = torch.frombuffer(bytearray(vectors[d]), dtype=torch.float32)
            self._upload(self.tables.table[row], values.to(self.dtype))
            self._rows[d] = [row, 1]
        entries = [
            _Entry(
                (int(layer), str(hook)),
                self._rows[d][0],
                float(a),
                float(b),
                str(tier),
                pos if isinstance(pos, str) else tuple(pos),
            )
            for layer, hook, d, a, b, tier, pos in steer["entries"]
            if (int(layer), str(hook)) in self.tables.index  # else another stage's layer
        ]
        return _Request(prompt_len, entries, list(vectors))

    def _release(self, digests: list[str]) -> None:
        for d in digests:
            slot = self._rows[d]
            slot[1] -= 1
            if slot[1] == 0:
                del self._rows[d]
                self._free.append(slot[0])  # stale values stay: nothing indexes the row

    # ---------------------------------------------------------------------- step
    def fill(self, req_ids: list[str], offsets: np.ndarray, starts: dict[str, int]) -> None:
        """Write this step's per-token indices and coefficients (before the forward)."""
        n = int(offsets[-1]) if len(offsets) else 0
        k_max = self.tables.per_token
        active: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        if self._reqs:
            for i, rid in enumerate(req_ids):
                st = self._reqs.get(rid)
                lo, hi = int(offsets[i]), int(offsets[i + 1])
                if st is None or lo == hi:
                    continue
                start = starts.get(rid, 0)
                pos = None if hi - lo == 1 else start + np.arange(hi - lo, dtype=np.int64)
                for e in st.entries:
                    if pos is None:  # a decode step: plain Python is faster than numpy
                        if not e.steers(start, st.prompt_len):
                            continue
                        rows = lo
                    else:
                        m = e.mask(pos, st.prompt_len)
                        if not m.any():
                            continue
                        rows = lo + np.flatnonzero(m)
                    if e.point not in active:
                        active[e.point] = (
                            np.zeros((n, k_max), dtype=np.int64),
                            np.zeros((n, k_max, 2), dtype=np.float32),
                            np.zeros(n, dtype=np.int64),
                        )
                    idx, coef, count = active[e.point]
                    k = count[rows]  # the front end admits at most k_max per point
                    idx[rows, k] = e.slot
                    coef[rows, k, 0] = e.a
                    coef[rows, k, 1] = e.b
                    count[rows] += 1
        for point, (idx, coef, _) in active.items():
            self._upload(self.tables.index[point][:n], torch.from_numpy(idx))
            self._upload(self.tables.coef[point][:n], torch.from_numpy(coef))
        for point in self._dirty - active.keys():
            self.tables.index[point].zero_()
            self.tables.coef[point].zero_()
        self._dirty = set(active)

    @property
    def rows_in_use(self) -> int:
        return len(self._rows)
