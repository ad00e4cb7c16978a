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


TIER_CODES = {"base": 0, "prefill": 1, "decode": 2}
POSITION_CODES = {"all": 0, "prompt": 1, "generated": 2, "last_prompt": 3}
LISTED = 4  # an explicit list of positions


@dataclass
class _Request:
    """One request's steering, as arrays: one element per entry this rank steers."""

    prompt_len: int
    point: np.ndarray  # int64: index into ``Steerer.points``
    slot: np.ndarray  # int64: row of the vector table
    a: np.ndarray  # float32
    b: np.ndarray  # float32
    tier: np.ndarray  # int8: TIER_CODES
    mode: np.ndarray  # int8: POSITION_CODES, or LISTED
    listed: dict[int, np.ndarray]  # entry -> its sorted positions (mode LISTED)
    digests: list[str]


@dataclass
class _Batch:
    """The steered requests of one batch, their entries concatenated (one element per
    entry); ``req`` maps an entry to its request's place in ``key``."""

    whole: tuple[str, ...]  # the batch's request ids, in order
    key: tuple[str, ...]  # the steered requests' ids, in batch order
    where: np.ndarray  # their places in the batch
    prompt_len: np.ndarray
    point: np.ndarray
    slot: np.ndarray
    a: np.ndarray
    b: np.ndarray
    tier: np.ndarray
    mode: np.ndarray
    req: np.ndarray
    listed: dict[int, np.ndarray]  # entry -> its positions (mode LISTED)


def _entry_mask(
    tier: np.ndarray, mode: np.ndarray, pos: np.ndarray, prompt_len: np.ndarray
) -> np.ndarray:
    """Which (entry, token) pairs are steered, from each pair's tier, position mode,
    position and prompt length (``LISTED`` pairs are decided by the caller)."""
    prompt = pos < prompt_len
    keep = np.where(tier == 1, prompt, np.where(tier == 2, ~prompt, True))
    by_mode = np.select(
        [mode == 1, mode == 2, mode == 3],
        [prompt, ~prompt, pos == prompt_len - 1],
        default=True,
    )
    return keep & by_mode


class Steerer:
    """Owns a model's steering tables on one rank."""

    def __init__(self, tables: SteerTables) -> None:
        self.tables = tables
        self.points = tables.points
        self._point_ids = {p: i for i, p in enumerate(self.points)}
        self.dtype = tables.table.dtype
        self._rows: dict[str, list[int]] = {}  # digest -> [table row, requests using it]
        self._free = list(range(tables.table.shape[0] - 1, 0, -1))  # row 0 stays zero
        self._reqs: dict[str, _Request] = {}
        self._dirty: set[tuple[int, str]] = set()
        self._last: _Batch | None = None  # the last batch laid out, reused while unchanged
        self._steady: tuple | None = None  # the last pure decode step's layout (_steady_key)
        self.skipped = 0  # requests not steered because the table was full
        self._upload = _Upload(tables.table.device)

    # ------------------------------------------------------------------ requests
    def admit(self, sr: StepRequests) -> None:
        """Take in new requests' steering and free what ended requests held."""
        for rid in sr.finished:
            st = self._reqs.pop(rid, None)
            if st is not None:
                self._release(st.digests)
                self._last = self._steady = None
        for rid, prompt_len, wire in sr.new:
            if rid in self._reqs:  # resumed after preemption
                continue
            steer = wire.get("steer") if wire else None
            if steer:
                st = self._take(rid, prompt_len, steer)
                if st is not None:
                    self._reqs[rid] = st
                    self._last = self._steady = None

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
        mine = [e for e in steer["entries"] if (int(e[0]), str(e[1])) in self._point_ids]
        # (entries of layers this rank does not hold belong to another pipeline stage)
        listed = {
            j: np.asarray(e[6], dtype=np.int64)
            for j, e in enumerate(mine)
            if not isinstance(e[6], str)
        }
        return _Request(
            prompt_len,
            np.array([self._point_ids[(int(e[0]), str(e[1]))] for e in mine], dtype=np.int64),
            np.array([self._rows[e[2]][0] for e in mine], dtype=np.int64),
            np.array([e[3] for e in mine], dtype=np.float32),
            np.array([e[4] for e in mine], dtype=np.float32),
            np.array([TIER_CODES[str(e[5])] for e in mine], dtype=np.int8),
            np.array(
                [LISTED if j in listed else POSITION_CODES[str(e[6])] for j, e in enumerate(mine)],
                dtype=np.int8,
            ),
            listed,
            list(vectors),
        )

    def _release(self, digests: list[str]) -> None:
        for d in digests:
            slot = self._rows[d]
            slot[1] -= 1
            if slot[1] == 0:
                del self._rows[d]
                self._free.append(slot[0])  # stale values stay: nothing indexes the row

    # ---------------------------------------------------------------------- step
    def fill(self, req_ids: list[str], offsets: np.ndarray, starts: dict[str, int]) -> None:
        """Write this step's per-token indices and coefficients (before the forward).

        Vectorized over (entry, token) pairs: the host cost of a step is a handful of
        numpy calls whatever the batch, not a Python loop over requests x entries."""
        n = int(offsets[-1]) if len(offsets) else 0
        batch = self._batch(req_ids) if self._reqs and n else None
        if batch is None:
            active: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            self._steady = None
        else:
            offsets = np.asarray(offsets, dtype=np.int64)
            first = np.array([starts.get(rid, 0) for rid in batch.key], dtype=np.int64)
            steady = self._steady_key(batch, offsets, first)
            if steady is not None and steady == self._steady:
                return  # the same decode batch as last step: the tables already hold it
            self._steady = steady
            active = self._lay_out(batch, offsets, first, n)
        for p, (idx, coef) in active.items():
            point = self.points[p]
            self._upload(self.tables.index[point][:n], torch.from_numpy(idx))
            self._upload(self.tables.coef[point][:n], torch.from_numpy(coef))
        now = {self.points[p] for p in active}
        for point in self._dirty - now:
            self.tables.index[point].zero_()
            self.tables.coef[point].zero_()
        self._dirty = now

    @staticmethod
    def _steady_key(bt: _Batch, offsets: np.ndarray, first: np.ndarray) -> tuple | None:
        """For a pure decode step (one generated token per steered request) of a batch
        with no listed positions, what its layout depends on: the batch and its rows.
        Every entry then steers either every generated token or none, so two such steps
        with the same batch and rows lay out the same tables. None otherwise."""
        if bt.listed:
            return None
        lo = offsets[bt.where]
        if not (np.all(offsets[bt.where + 1] - lo == 1) and np.all(first >= bt.prompt_len)):
            return None
        return bt.whole, offsets.tobytes()

    def _batch(self, req_ids: list[str]) -> _Batch | None:
        """The steered requests of this batch, their entries concatenated; kept while
        the batch stays the same (decode steps, mostly)."""
        whole = tuple(req_ids)
        if self._last is not None and self._last.whole == whole:
            return self._last
        where = [i for i, rid in enumerate(req_ids) if rid in self._reqs]
        if not where:
            return None
        key = tuple(req_ids[i] for i in where)
        cat = [self._reqs[rid] for rid in key]
        per_req = np.array([len(st.point) for st in cat], dtype=np.int64)
        base = np.cumsum(per_req) - per_req
        self._last = _Batch(
            whole=whole,
            key=key,
            where=np.asarray(where, dtype=np.int64),
            prompt_len=np.array([st.prompt_len for st in cat], dtype=np.int64),
            point=np.concatenate([st.point for st in cat]),
            slot=np.concatenate([st.slot for st in cat]),
            a=np.concatenate([st.a for st in cat]),
            b=np.concatenate([st.b for st in cat]),
            tier=np.concatenate([st.tier for st in cat]),
            mode=np.concatenate([st.mode for st in cat]),
            req=np.repeat(np.arange(len(cat)), per_req),
            listed={int(base[k] + j): v for k, st in enumerate(cat) for j, v in st.listed.items()},
        )
        return self._last

    def _lay_out(
        self, bt: _Batch, offsets: np.ndarray, first: np.ndarray, n: int
    ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Point index -> (indices [n, K], coefficients [n, K, 2]) for the points this
        step steers; tokens and slots nobody steers stay 0 (row 0 of the table)."""
        lo = offsets[bt.where]
        count = offsets[bt.where + 1] - lo
        req, point, slot, a, b = bt.req, bt.point, bt.slot, bt.a, bt.b
        # Every (entry, token of its request in this step) pair.
        reps = count[req]
        pair = np.repeat(np.arange(len(req)), reps)  # pair -> its entry
        within = np.arange(len(pair)) - np.repeat(np.cumsum(reps) - reps, reps)
        r = req[pair]
        row = lo[r] + within
        pos = first[r] + within
        keep = _entry_mask(bt.tier[pair], bt.mode[pair], pos, bt.prompt_len[r])
        for entry, positions in bt.listed.items():
            sel = pair == entry
            keep[sel] &= np.isin(pos[sel], positions)
        pair, row = pair[keep], row[keep]
        if not len(pair):
            return {}
        p = point[pair]
        # Each (point, row)'s entries take slots 0, 1, ... in order (the front end
        # admits at most per_token entries per point).
        order = np.lexsort((pair, row, p))
        pair, row, p = pair[order], row[order], p[order]
        key = p * n + row
        run_start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        k = np.arange(len(key)) - np.repeat(run_start, np.diff(np.r_[run_start, len(key)]))
        k_max = self.tables.per_token
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for pid in np.unique(p):
            m = p == pid
            idx = np.zeros((n, k_max), dtype=np.int64)
            coef = np.zeros((n, k_max, 2), dtype=np.float32)
            rr, kk, ee = row[m], k[m], pair[m]
            idx[rr, kk] = slot[ee]
            coef[rr, kk, 0] = a[ee]
            coef[rr, kk, 1] = b[ee]
            out[int(pid)] = (idx, coef)
        return out

    @property
    def rows_in_use(self) -> int:
        return len(self._rows)
