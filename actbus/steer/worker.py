"""Worker side of steering: the per-token tables filled before each forward.

Runs on every rank (tensor-parallel ranks each add the same vector to their copy of
the stream; a pipeline stage steers the layers it owns). Requests arrive with their
steering resolved (``actbus.steer.frontend``): vectors by digest with their values,
entries as (layer, hook, digest, a, b, tier, positions). A vector gets a row of the
device table while some request in flight uses it (rows are shared by digest and
counted); a live vector's entry is resolved at admission to the version in use then
(``actbus.steer.live``: its values, and its norm for norm matching), kept to the
request's end; ``fill`` writes each steered point's indices and coefficients for this
step's tokens, and zeroes a point's buffers once no token is steered there.

Gated entries (``GateTables``) also get, per (token, slot), where their gate's score
is read: this step's score buffer of a monitor point that runs before the steered
point (the same token, or the token before when it is in this step too), or the
``carry`` buffer, which ``fill`` fills on the device from ``last``: per request, the
scores of its last token in the step before, saved at the start of the next ``fill``
(before the next forward overwrites the score buffers; stream order on CUDA, no host
sync). A gate on the previous token is closed for position 0, and for every prompt
token when its monitor runs after the steered point (a prompt's scores at that point
are not computed yet when the point is steered in the same forward).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actbus.fields import FLOAT32_MAX
from actbus.steer.config import monitor_runs_before
from actbus.steer.graph import GateTables, SteerTables
from actbus.steer.live import LIVE_PREFIX, LiveVectors
from actbus.steps import StepRequests

log = logging.getLogger("actbus.steer")


class _Upload:
    """Host-to-device copies that do not stall the host on CUDA.

    A copy from pageable memory waits for the stream to drain, which would undo vLLM's
    overlap of input preparation with the previous forward. Each copy goes through a
    pinned staging buffer, kept (with an event) until the copy has run; copies stay in
    stream order, so the forward that follows reads the new values. Staging buffers are
    pooled by size (powers of two) and reused once their copy has run: a fresh
    ``pin_memory()`` per copy (``cudaHostAlloc``) was 12.5% of the engine thread's
    busy time when ablating at 32 layers (benchmarks/RESULTS.md, issue 47). On CPU: a
    copy."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._free: dict[int, list[torch.Tensor]] = {}
        self._inflight: list[tuple[int, torch.Tensor, Any]] = []

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        self._reclaim()
        src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        size = max(4096, 1 << max(0, nbytes - 1).bit_length())
        pool = self._free.setdefault(size, [])
        buf = pool.pop() if pool else self._pinned(size)
        host = buf[:nbytes].view(src.dtype).view(src.shape)
        host.copy_(src)
        dst.copy_(host, non_blocking=True)
        self._inflight.append((size, buf, self._recorded()))

    def _reclaim(self) -> None:
        """Staging buffers whose copy has run go back to their pool."""
        waiting = []
        for size, buf, done in self._inflight:
            if done.query():
                self._free[size].append(buf)
            else:
                waiting.append((size, buf, done))
        self._inflight = waiting

    def _pinned(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def _recorded(self) -> Any:
        done = torch.cuda.Event()
        done.record()
        return done


_KEY = 1 << 32
"""``entry * _KEY + position``: one key per listed (entry, position); positions are
below vLLM's context lengths, far below 2**32."""
_GATE_ARRAYS = ("kind", "m", "col", "thr", "sharp")
TIER_CODES = {"base": 0, "prefill": 1, "decode": 2}
POSITION_CODES = {"all": 0, "prompt": 1, "generated": 2, "last_prompt": 3}
LISTED = 4  # an explicit list of positions
COEFS = 7
"""Coefficients per entry: ``(a, b)`` of ``add`` and the other operations' ``(c, e, d,
t, z)`` (``actbus.steer.graph``); a point's buffer holds as many as its ops need."""
_NO_TERMS = (0.0,) * (COEFS - 2)


@dataclass
class _Request:
    """One request's steering, as arrays: one element per entry this rank steers."""

    prompt_len: int
    point: np.ndarray  # int64: index into ``Steerer.points``
    slot: np.ndarray  # int64: row of the vector table
    cf: np.ndarray  # float32 [entries, COEFS]: (a, b, c, e, d, t, z)
    tier: np.ndarray  # int8: TIER_CODES
    mode: np.ndarray  # int8: POSITION_CODES, or LISTED
    listed: dict[int, np.ndarray]  # entry -> its sorted positions (mode LISTED)
    digests: list[str]
    gate: _Gates | None = None
    live: dict[str, int] | None = None  # live vector -> the version it steers with

    @property
    def a(self) -> np.ndarray:
        return self.cf[:, 0]

    @property
    def b(self) -> np.ndarray:
        return self.cf[:, 1]


@dataclass
class _Gates:
    """One request's gates, one element per entry (kind 0: ungated)."""

    kind: np.ndarray  # int8: 0 none, 1 this token's score, 2 the previous token's
    m: np.ndarray  # int64: the monitor point (``GateTables.monitor_points``), -1 none
    col: np.ndarray  # int64: the column in that point's score buffer
    thr: np.ndarray  # float32
    sharp: np.ndarray  # float32 (0: a hard threshold)
    slot: int = 0  # its row of ``GateTables.last`` (0: it has no previous-token gate)

    @classmethod
    def none(cls, n: int) -> _Gates:
        return cls(
            np.zeros(n, np.int8),
            np.full(n, -1, np.int64),
            np.zeros(n, np.int64),
            np.zeros(n, np.float32),
            np.zeros(n, np.float32),
        )


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
    cf: np.ndarray
    tier: np.ndarray
    mode: np.ndarray
    req: np.ndarray
    listed: dict[int, np.ndarray]  # entry -> its positions (mode LISTED)
    gate: _Gates | None = None  # concatenated; ``slot`` unused
    listed_entry: np.ndarray | None = None  # bool per entry: its positions are listed
    listed_keys: np.ndarray | None = None  # sorted ``entry * _KEY + position`` of them
    listed_late: bool = False  # a listed position past its request's prompt
    gate_slot: np.ndarray | None = None  # per steered request: its row of ``last``
    by_point: np.ndarray | None = None  # the entries grouped by point, in entry order
    stacked: bool = False  # a request has two entries at one point


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


def _token_slots(p: np.ndarray, row: np.ndarray, n: int) -> np.ndarray:
    """Each kept pair's slot of its token's ``per_token`` at its point: (point, row)'s
    entries take slots 0, 1, ... in entry order (the front end admits at most
    per_token of them). The pairs come point by point, each entry's rows ascending,
    so the stable sort mostly meets runs already in order."""
    key = p * n + row
    order = np.argsort(key, kind="stable")
    grouped = key[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    k = np.empty(len(key), dtype=np.int64)
    k[order] = np.arange(len(key)) - np.repeat(starts, np.diff(np.r_[starts, len(key)]))
    return k


def _point_order(bt: _Batch, points: int) -> tuple[np.ndarray, bool]:
    """The batch's entries grouped by point (in entry order within one), and whether a
    request has two entries at one point (else no token does, and a step's slots are
    all 0: no ``_token_slots`` sort)."""
    key = bt.req * points + bt.point
    return np.argsort(bt.point, kind="stable"), len(np.unique(key)) < len(key)


class Steerer:
    """Owns a model's steering tables on one rank."""

    def __init__(
        self,
        tables: SteerTables,
        gates: GateTables | None = None,
        columns: dict[tuple[str, int], tuple[int, dict[int, int]]] | None = None,
        live: LiveVectors | None = None,
    ) -> None:
        """``gates`` and ``columns`` ((monitor, layer) -> its monitor point and each
        feature's column, -1 for a single score) on engines whose steering can be gated;
        ``live``: the engine's live vectors, which pushes change (``push``)."""
        self.tables = tables
        self.live = live
        self.points = tables.points
        self.gates = gates
        self.columns = columns or {}
        self._gate_free: list[int] = []
        self._save: list | None = None  # (m, slots, rows) of the step just run, on device
        self._save_plan: list | None = None  # the same, for the step being laid out
        self._carry: list[tuple] = []  # (point, m, dst, src) device index pairs
        if gates is not None:
            mp = gates.monitor_points
            self._jmap = np.full((len(self.points), len(mp)), -1, dtype=np.int64)
            for p, point in enumerate(self.points):
                for j, m in enumerate(gates.inputs[point]):
                    self._jmap[p, m] = j
            self._n_in = np.array([len(gates.inputs[pt]) for pt in self.points], dtype=np.int64)
            self._before = np.array(
                [[monitor_runs_before(m, pt) for m in mp] for pt in self.points], dtype=bool
            ).reshape(len(self.points), len(mp))
            self._width = np.array([b.shape[1] for b in gates.scores], dtype=np.int64)
            self._gate_free = list(range(gates.slots - 1, 0, -1))  # row 0 unused
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
    def push(self, name: str, version: int, values: np.ndarray) -> bool:
        """Make ``version`` of live vector ``name`` the one requests admitted from now on
        steer with (called before the step's admissions); rows in use stay as they are."""
        return self.live is not None and self.live.put(name, version, values)

    def live_versions(self, rid: str) -> dict[str, int]:
        """The live vectors a request steers with, each at its version ({}: none)."""
        st = self._reqs.get(rid)
        return dict(st.live) if st is not None and st.live else {}

    def _resolve_live(self, rid: str, steer: dict) -> tuple[dict, dict[str, int]] | None:
        """The wire steering with each live vector's entries at the version in use now
        (their key ``live:NAME:VERSION``, norm matching divided by that version's norm),
        and the versions; None when it names no live vector."""
        entries = steer["entries"]
        if not any(str(e[2]).startswith(LIVE_PREFIX) for e in entries):
            return None
        vectors = dict(steer["vectors"])
        versions: dict[str, int] = {}
        out = []
        for e in entries:
            key = str(e[2])
            if not key.startswith(LIVE_PREFIX):
                out.append(e)
                continue
            name = key[len(LIVE_PREFIX) :]
            lv = self.live.get(name) if self.live is not None else None
            if lv is None:  # the front end checks names against the same config
                log.error("actbus: request %s: no live vector %s on this worker", rid, name)
                continue
            versions[name] = lv.version
            vectors[lv.key] = lv.vector.values.tobytes()
            b = float(e[4])
            if b:  # within float32 (a tiny norm can push it past; the graph bounds the rest)
                b = b / lv.vector.norm if lv.vector.norm > 0.0 else 0.0
                b = min(max(b, -FLOAT32_MAX), FLOAT32_MAX)
            out.append([e[0], e[1], lv.key, e[3], b, *e[5:]])
        return {"vectors": vectors, "entries": out}, versions

    def admit(self, sr: StepRequests) -> None:
        """Take in new requests' steering and free what ended requests held."""
        for rid in sr.finished:
            st = self._reqs.pop(rid, None)
            if st is not None:
                self._release(st.digests)
                if st.gate is not None and st.gate.slot:
                    self._gate_free.append(st.gate.slot)
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
        resolved = self._resolve_live(rid, steer)
        live = None
        if resolved is not None:
            steer, live = resolved
        vectors: dict[str, bytes] = steer["vectors"]
        need = [d for d in vectors if d not in self._rows]
        if len(need) > len(self._free):
            self.skipped += 1
            log.error(  # the scheduler keeps such a request waiting (steer_rows): a bug
                "actbus: request %s is NOT steered: the steering table is full (%d rows in "
                "use), which the scheduler's count of rows should have prevented",
                rid, len(self._rows),
            )  # fmt: skip
            return None
        width = self.tables.table.shape[1]
        for d in vectors:
            if d in self._rows:
                self._rows[d][1] += 1
                continue
            row = self._free.pop()
            values = torch.frombuffer(bytearray(vectors[d]), dtype=torch.float32).to(self.dtype)
            self._upload(self.tables.table[row], values[:width])
            if self.tables.read is not None:  # a paired row's read half, else zeros
                read = values[width:] if len(values) > width else torch.zeros_like(values)
                self._upload(self.tables.read[row], read)
            self._rows[d] = [row, 1]
        mine = [e for e in steer["entries"] if (int(e[0]), str(e[1])) in self._point_ids]
        # (entries of layers this rank does not hold belong to another pipeline stage)
        gated = self._gates_of(rid, mine)
        gate = None
        if gated is not None:
            gate, keep = gated
            mine = [e for e, k in zip(mine, keep, strict=True) if k]
        listed = {
            j: np.asarray(e[6], dtype=np.int64)
            for j, e in enumerate(mine)
            if not isinstance(e[6], str)
        }
        return _Request(
            prompt_len,
            np.array([self._point_ids[(int(e[0]), str(e[1]))] for e in mine], dtype=np.int64),
            np.array([self._rows[e[2]][0] for e in mine], dtype=np.int64),
            np.array(
                [[e[3], e[4], *(e[8] if len(e) > 8 else _NO_TERMS)] for e in mine],
                dtype=np.float32,
            ).reshape(len(mine), COEFS),
            np.array([TIER_CODES[str(e[5])] for e in mine], dtype=np.int8),
            np.array(
                [LISTED if j in listed else POSITION_CODES[str(e[6])] for j, e in enumerate(mine)],
                dtype=np.int8,
            ),
            listed,
            list(vectors),
            gate,
            live,
        )

    def _gates_of(self, rid: str, mine: list) -> tuple[_Gates, list[bool]] | None:
        """The gates of a request's entries (None: none is gated), and which entries
        this rank can steer (a gate whose monitor it does not score is left out)."""
        raw = [e[7] if len(e) > 7 else None for e in mine]
        if not any(raw):
            return None
        g = _Gates.none(len(mine))
        keep = [True] * len(mine)
        for j, gate in enumerate(raw):
            if not gate:
                continue
            name, layer, _hook, feature, thr, sharp, source = gate
            where = self.columns.get((str(name), int(layer)))
            if where is None or int(feature) not in where[1]:
                log.error(
                    "actbus: request %s: monitor %s at layer %s is not scored on this rank; "
                    "its gated steering there is left out", rid, name, layer,
                )  # fmt: skip
                keep[j] = False
                continue
            g.kind[j] = 1 if source == "token" else 2
            g.m[j], g.col[j] = where[0], where[1][int(feature)]
            g.thr[j], g.sharp[j] = float(thr), float(sharp)
        if (g.kind == 2).any():
            if not self._gate_free:
                log.error("actbus: request %s: no slot left for previous-token gates", rid)
                keep = [k and g.kind[j] != 2 for j, k in enumerate(keep)]
            else:
                g.slot = self._gate_free.pop()
        sel = np.asarray(keep, dtype=bool)
        return (
            _Gates(g.kind[sel], g.m[sel], g.col[sel], g.thr[sel], g.sharp[sel], g.slot),
            keep,
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
        self._save_last()
        n = int(offsets[-1]) if len(offsets) else 0
        batch = self._batch(req_ids) if self._reqs and n else None
        if batch is None:
            active: dict[int, tuple[np.ndarray, ...]] = {}
            self._steady = None
            self._carry, self._save_plan = [], None
        else:
            offsets = np.asarray(offsets, dtype=np.int64)
            first = np.array([starts.get(rid, 0) for rid in batch.key], dtype=np.int64)
            steady = self._steady_key(batch, offsets, first)
            if steady is not None and steady == self._steady:
                self._fill_carry()  # the previous tokens' scores are new each step
                self._save = self._save_plan
                return  # the same decode batch as last step: the tables already hold it
            self._steady = steady
            active = self._lay_out(batch, offsets, first, n)
        gates = self.gates
        for p, (idx, coef, *gate) in active.items():
            point = self.points[p]
            self._upload(self.tables.index[point][:n], torch.from_numpy(idx))
            self._upload(self.tables.coef[point][:n], torch.from_numpy(coef))
            if gates is not None:
                src, gidx, par = gate
                self._upload(gates.src[point][:n], torch.from_numpy(src))
                self._upload(gates.idx[point][:n], torch.from_numpy(gidx))
                self._upload(gates.par[point][:n], torch.from_numpy(par))
        now = {self.points[p] for p in active}
        for point in self._dirty - now:
            self.tables.index[point].zero_()
            self.tables.coef[point].zero_()
        self._dirty = now
        self._fill_carry()
        self._save = self._save_plan

    def _device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.empty(a.shape, dtype=torch.int64, device=self.tables.table.device)
        self._upload(t, torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)))
        return t

    def _save_last(self) -> None:
        """Keep, per request with a previous-token gate, the score rows of its last
        token in the step just run (its monitor points' buffers still hold them)."""
        if self._save is None or self.gates is None:
            return
        g = self.gates
        for m, slots, rows in self._save:
            g.last[m].index_copy_(0, slots, g.scores[m].index_select(0, rows))
        self._save = None

    def _fill_carry(self) -> None:
        """Copy each carried gate's previous score from ``last`` into its point's buffer."""
        if self.gates is None:
            return
        g = self.gates
        for point, m, dst, src in self._carry:
            g.carry[point].view(-1).index_copy_(0, dst, g.last[m].view(-1).index_select(0, src))

    @staticmethod
    def _steady_key(bt: _Batch, offsets: np.ndarray, first: np.ndarray) -> tuple | None:
        """For a pure decode step (one generated token per steered request) of a batch
        with no listed positions past a prompt, what its layout depends on: the batch
        and its rows.
        Every entry then steers either every generated token or none, so two such steps
        with the same batch and rows lay out the same tables. None otherwise."""
        if bt.listed_late:  # (listed prompt positions steer no generated token)
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
            cf=np.concatenate([st.cf for st in cat]),
            tier=np.concatenate([st.tier for st in cat]),
            mode=np.concatenate([st.mode for st in cat]),
            req=np.repeat(np.arange(len(cat)), per_req),
            listed={int(base[k] + j): v for k, st in enumerate(cat) for j, v in st.listed.items()},
        )
        self._last.by_point, self._last.stacked = _point_order(self._last, len(self.points))
        if self._last.listed:
            entries = np.fromiter(self._last.listed, dtype=np.int64)
            self._last.listed_entry = np.zeros(len(self._last.point), dtype=bool)
            self._last.listed_entry[entries] = True
            self._last.listed_keys = np.sort(
                np.concatenate([e * _KEY + v for e, v in self._last.listed.items()])
            )
        self._last.listed_late = any(
            len(v) and int(v[-1]) >= st.prompt_len for st in cat for v in st.listed.values()
        )
        if any(st.gate is not None for st in cat):
            gs = [st.gate or _Gates.none(len(st.point)) for st in cat]
            self._last.gate = _Gates(
                *(np.concatenate([getattr(g, f) for g in gs]) for f in _GATE_ARRAYS)
            )
            self._last.gate_slot = np.array([g.slot for g in gs], dtype=np.int64)
        return self._last

    def _lay_out(
        self, bt: _Batch, offsets: np.ndarray, first: np.ndarray, n: int
    ) -> dict[int, tuple[np.ndarray, ...]]:
        """Point index -> (indices [n, K], coefficients [n, K, 2], and with gates: gate
        sources [n, K], flat indices [n, K], (threshold, sharpness) [n, K, 2]) for the
        points this step steers; tokens and slots nobody steers stay 0 (row 0 of the
        table). Also plans the gates' carried scores (``_carry``, ``_save_plan``)."""
        lo = offsets[bt.where]
        count = offsets[bt.where + 1] - lo
        req, point, slot, cf = bt.req, bt.point, bt.slot, bt.cf
        width = self.tables.coefs
        # Every (entry, token of its request in this step) pair, point by point.
        assert bt.by_point is not None
        reps = count[req[bt.by_point]]
        pair = np.repeat(bt.by_point, reps)  # pair -> its entry
        within = np.arange(len(pair)) - np.repeat(np.cumsum(reps) - reps, reps)
        r = req[pair]
        row = lo[r] + within
        pos = first[r] + within
        keep = _entry_mask(bt.tier[pair], bt.mode[pair], pos, bt.prompt_len[r])
        if bt.listed:  # one membership test for every listed entry's pairs
            sel = bt.listed_entry[pair]
            keep[sel] &= np.isin(pair[sel] * _KEY + pos[sel], bt.listed_keys)
        gt = bt.gate
        if gt is not None:  # previous-token gates closed where there is no such score
            prev = gt.kind[pair] == 2
            before = self._before[point[pair], np.maximum(gt.m[pair], 0)]
            keep &= ~(prev & ((pos == 0) | (~before & (pos < bt.prompt_len[r]))))
        pair, row, within, r = pair[keep], row[keep], within[keep], r[keep]
        self._carry, self._save_plan = [], None
        if gt is not None:
            self._plan_save(bt, lo, count)
        if not len(pair):
            return {}
        p = point[pair]  # sorted: the pairs come point by point
        k = _token_slots(p, row, n) if bt.stacked else np.zeros(len(pair), dtype=np.int64)
        k_max = self.tables.per_token
        if gt is not None:
            g_src, g_idx, carried = self._gate_sources(bt, pair, p, row, within, r)
        # One array per table for all the step's points (a point's are views of it):
        # a handful of numpy calls a step, whatever the number of points.
        bounds = np.flatnonzero(np.r_[True, p[1:] != p[:-1], True])
        pids = p[bounds[:-1]]
        at = np.repeat(np.arange(len(pids)), np.diff(bounds))  # pair -> its point's place
        idx = np.zeros((len(pids), n, k_max), dtype=np.int64)
        coef = np.zeros((len(pids), n, k_max, width), dtype=np.float32)
        idx[at, row, k] = slot[pair]
        coef[at, row, k] = cf[pair, :width]
        if self.gates is None:
            return {int(pid): (idx[i], coef[i]) for i, pid in enumerate(pids)}
        src = np.full((len(pids), n, k_max), -1, dtype=np.int64)
        gidx = np.zeros((len(pids), n, k_max), dtype=np.int64)
        par = np.zeros((len(pids), n, k_max, 2), dtype=np.float32)
        if gt is not None:
            src[at, row, k] = g_src
            gidx[at, row, k] = g_idx
            par[at, row, k, 0] = gt.thr[pair]
            par[at, row, k, 1] = gt.sharp[pair]
            for i, (lo_, hi_) in enumerate(itertools.pairwise(bounds)):
                c = np.flatnonzero(carried[lo_:hi_]) + lo_
                if len(c):
                    self._plan_carry(int(pids[i]), gt, pair[c], row[c] * k_max + k[c], r[c], bt)
        return {int(pid): (idx[i], coef[i], src[i], gidx[i], par[i]) for i, pid in enumerate(pids)}

    def _gate_sources(self, bt: _Batch, pair, p, row, within, r):
        """Per kept pair: its gate source (-1 ungated, j: the point's j-th monitor
        buffer, J: carried), its flat index in that buffer, and whether it is carried."""
        gt = bt.gate
        assert gt is not None
        kind, m = gt.kind[pair], np.maximum(gt.m[pair], 0)
        j = self._jmap[p, m]
        width = self._width[m]
        col = gt.col[pair]
        # The previous token in this step, scored before this point: read it there.
        in_step = (kind == 2) & (within > 0) & (j >= 0)
        carried = (kind == 2) & ~in_step
        src = np.where(kind == 0, -1, np.where(carried, self._n_in[p], j))
        src_row = np.where(in_step, row - 1, row)
        return src, src_row * width + col, carried

    def _plan_carry(self, pid: int, gt: _Gates, entries, dst, r, bt: _Batch) -> None:
        """Device index pairs copying ``last[m][slot, col]`` into the point's carry."""
        m = gt.m[entries]
        slots = bt.gate_slot[r]
        for mm in np.unique(m):
            sel = m == mm
            src = slots[sel] * self._width[mm] + gt.col[entries[sel]]
            self._carry.append(
                (self.points[pid], int(mm), self._device(dst[sel]), self._device(src))
            )

    def _plan_save(self, bt: _Batch, lo: np.ndarray, count: np.ndarray) -> None:
        """Which score rows to keep after this step: each previous-gated request's last
        token, at each monitor point its gates read."""
        gt = bt.gate
        assert gt is not None and bt.gate_slot is not None
        prev = gt.kind == 2
        if not prev.any():
            return
        slots, rows, ms = [], [], []
        for m in np.unique(gt.m[prev]):
            reqs = np.unique(bt.req[prev & (gt.m == m)])
            reqs = reqs[count[reqs] > 0]
            if len(reqs):
                ms.append(int(m))
                slots.append(bt.gate_slot[reqs])
                rows.append(lo[reqs] + count[reqs] - 1)
        plan = zip(ms, slots, rows, strict=True)
        self._save_plan = [(m, self._device(sl), self._device(rw)) for m, sl, rw in plan]

    @property
    def rows_in_use(self) -> int:
        return len(self._rows)
