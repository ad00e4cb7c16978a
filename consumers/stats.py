"""Activation statistics and bus health: one implementation for every dashboard.

``ActivationStats`` digests sampled batches into per-(layer, hook) figures: the
distribution of per-token L2 norms (a histogram over a recent window), the mean
and variance of the activations and how far they drifted from the first rows
seen (the reference), the fraction of outlier hidden dimensions, and per-tag
breakdowns. Rows holding a NaN or an infinity are counted per tap (a health
signal of its own) and kept out of every other figure, so one bad row can neither
poison the averages nor stop the digest. ``BusHealth`` turns two snapshots of
the publisher's own counters (``Publisher.stats()``) into rates, lags, drops and
spill sizes. ``RecentRequests`` keeps per-token norms of the last requests seen,
for the web view (a non-finite norm as NaN: the web server sends it as null). All
snapshots are plain JSON-able dicts, so the W&B logger and the web page render the
same data.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actbus.bus import Batch
from actbus.streams import point_key

_NO_ROWS = np.zeros(0)
_NO_ROWS.setflags(write=False)

OTHER_TAG = "(other)"
"""Tag values past ``StatsConfig.max_tag_values`` are counted under this name."""


@dataclass(frozen=True)
class StatsConfig:
    """How activations are summarised."""

    bins: int = 32
    """Histogram bins for the per-token norm distribution."""
    window_rows: int = 8192
    """Norms kept per tap for the histogram and the norm mean/std (most recent rows)."""
    reference_rows: int = 256
    """Rows whose mean and variance are the reference the drift is measured against."""
    ema: float = 0.1
    """Weight of each new batch in the current mean/variance (exponential average)."""
    outlier_k: float = 6.0
    """A hidden dimension is an outlier in a batch when its largest magnitude is above
    ``outlier_k`` times the RMS of the batch's median dimension (LLM.int8()-style
    outlier features, scale-free)."""
    outlier_batches: int = 64
    """Batches averaged for the outlier fraction."""
    max_tag_values: int = 64
    """Distinct ``key=value`` tag labels tracked; the rest go to ``(other)`` (counted)."""
    step_memory: int = 1 << 14
    """Distinct steps remembered for counting (steps arrive nearly in order)."""

    def __post_init__(self) -> None:
        for name in ("bins", "window_rows", "reference_rows", "outlier_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"StatsConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.ema <= 1:
            raise ValueError(f"StatsConfig.ema: must be in (0, 1], got {self.ema}")
        if self.outlier_k <= 0:
            raise ValueError(f"StatsConfig.outlier_k: must be > 0, got {self.outlier_k}")


@dataclass
class _Tap:
    """Running figures of one (layer, hook)."""

    layer: int
    hook: str
    hidden: int
    rows: int = 0
    batches: int = 0
    norms: deque[np.ndarray] = field(default_factory=deque)
    window: int = 0  # rows held in ``norms``
    ref_sum: np.ndarray | None = None
    ref_sq: np.ndarray | None = None
    ref_rows: int = 0
    ref_mean: np.ndarray | None = None
    ref_var: np.ndarray | None = None
    m1: np.ndarray | None = None  # exponential averages of x and x**2, per dimension
    m2: np.ndarray | None = None
    outliers: deque[float] = field(default_factory=deque)
    nonfinite: int = 0  # rows with a NaN or an infinity: counted, kept out of the figures


class ActivationStats:
    """Per-(layer, hook) activation statistics from sampled batches."""

    def __init__(self, config: StatsConfig | None = None) -> None:
        self.config = config or StatsConfig()
        self.taps: dict[str, _Tap] = {}
        self.tags: dict[str, dict[str, list[float]]] = {}  # label -> tap -> [rows, norm sum]
        self.tag_overflow_rows = 0
        self.nonfinite_rows = 0
        self.messages = 0
        self.rows = 0
        self.bytes = 0
        self.steps_counted = 0
        self.last_step = -1
        self._steps: set[int] = set()
        self._max_step = -1

    def add(self, batches: Sequence[Batch]) -> list[np.ndarray]:
        """Digest batches (any taps, in arrival order); returns each one's per-row
        norms (float64, numpy).

        The batches of one tap are digested together: a fixed handful of numpy calls
        per tap however many messages arrived, which is what keeps a dashboard's CPU
        small beside an engine that wants every core. The figures are those a
        batch-by-batch digest gives: per-batch moments feed the exponential averages
        and the outlier fractions in arrival order."""
        out: list[np.ndarray] = [_NO_ROWS] * len(batches)
        groups: dict[str, list[int]] = {}
        for i, b in enumerate(batches):
            h = b.header
            self.messages += 1
            self.bytes += h.nbytes
            self._count_step(h.step)
            groups.setdefault(point_key(h.layer, h.hook), []).append(i)
        for key, idx in groups.items():
            for i, norms in zip(idx, self._digest(key, [batches[i] for i in idx]), strict=True):
                out[i] = norms
                self._tags(batches[i].header.rows, norms, key)
        return out

    def _digest(self, key: str, batches: list[Batch]) -> list[np.ndarray]:
        """One tap's batches, in arrival order: their per-row norms (NaN or infinite
        for rows that hold a NaN or an infinity; those rows count in ``nonfinite``
        and nowhere else)."""
        xs = []
        for b in batches:
            x = b.tensor
            xs.append(x.reshape(x.shape[0], -1) if x.dim() != 2 else x)
        h = batches[0].header
        t = self.taps.get(key)
        if t is None:
            t = self.taps[key] = _Tap(h.layer, h.hook, int(xs[0].shape[1]))
        t.batches += len(batches)
        sizes = np.array([x.shape[0] for x in xs], dtype=np.int64)
        n = int(sizes.sum())
        if n == 0:
            return [_NO_ROWS] * len(batches)
        # numpy from here: its per-call cost is a fraction of torch's.
        xd = np.concatenate([x.float().numpy() for x in xs if x.shape[0]]).astype(np.float64)
        self.rows += n
        t.rows += n
        sq = xd * xd
        norms = np.sqrt(sq.sum(1))  # float64: finite squares of any float32, finite sum
        ends = np.cumsum(sizes)
        split = np.split(norms, ends[:-1])
        finite = np.isfinite(norms)  # False: the row holds a NaN or an infinity
        if not finite.all():
            bad = int(n - finite.sum())
            t.nonfinite += bad
            self.nonfinite_rows += bad
            xd, sq, norms = xd[finite], sq[finite], norms[finite]
            kept = np.concatenate([[0], np.cumsum(finite)])
            sizes = kept[ends] - kept[ends - sizes]
            ends = np.cumsum(sizes)
            if not len(norms):
                return split
        self._window(t, norms)
        self._reference(t, xd, sq)
        # Per-batch moments (not per-batch variances: a batch of a few rows would
        # bias those low); batches without (finite) rows carry no figures.
        # Slices, not ufunc.reduceat along axis 0: numpy's reduceat walks a
        # [rows, hidden] array column by column, 8x slower here than summing each
        # batch's contiguous block (a busy dashboard's whole core on an 8B's steps).
        spans = [(b - n_, b) for n_, b in zip(sizes.tolist(), ends.tolist(), strict=True) if n_]
        count = sizes[sizes > 0][:, None]
        m1 = np.stack([xd[a:b].sum(0) for a, b in spans]) / count
        m2 = np.stack([sq[a:b].sum(0) for a, b in spans]) / count
        t.m1 = self._ema(t.m1, m1)
        t.m2 = self._ema(t.m2, m2)
        # Against the median dimension's RMS: the outliers themselves do not raise the bar.
        typical = np.sqrt(np.median(m2, axis=1))
        peak = np.stack([np.abs(xd[a:b]).max(0) for a, b in spans])
        frac = (peak > self.config.outlier_k * typical[:, None]).mean(1)
        frac[typical == 0] = 0.0
        t.outliers.extend(frac.tolist())
        while len(t.outliers) > self.config.outlier_batches:
            t.outliers.popleft()
        return split

    def _ema(self, prev: np.ndarray | None, batches: np.ndarray) -> np.ndarray:
        """``prev`` moved toward each row of ``batches`` in turn by weight ``ema``, in
        one weighted sum: (1-a)^k prev + sum_j a (1-a)^(k-j) batch_j."""
        if prev is None:
            prev, batches = batches[0], batches[1:]
        k = len(batches)
        if k == 0:
            return prev
        a = self.config.ema
        weights = a * (1 - a) ** np.arange(k - 1, -1, -1, dtype=np.float64)
        return (1 - a) ** k * prev + weights @ batches

    def _count_step(self, step: int) -> None:
        if step in self._steps:
            return
        if step < self._max_step - self.config.step_memory:
            return  # far older than anything remembered: a duplicate of a forgotten step
        self._steps.add(step)
        self.steps_counted += 1
        self.last_step = max(self.last_step, step)
        if step > self._max_step:
            self._max_step = step
        if len(self._steps) > 2 * self.config.step_memory:
            floor = self._max_step - self.config.step_memory
            self._steps = {s for s in self._steps if s >= floor}

    def _window(self, t: _Tap, norms: np.ndarray) -> None:
        t.norms.append(norms)
        t.window += len(norms)
        while t.window - len(t.norms[0]) >= self.config.window_rows:
            t.window -= len(t.norms.popleft())

    def _reference(self, t: _Tap, xd: np.ndarray, sq: np.ndarray) -> None:
        if t.ref_mean is not None:
            return
        want = self.config.reference_rows - t.ref_rows
        take, take_sq = xd[:want], sq[:want]
        s, s2 = take.sum(0), take_sq.sum(0)
        t.ref_sum = s if t.ref_sum is None else t.ref_sum + s
        t.ref_sq = s2 if t.ref_sq is None else t.ref_sq + s2
        t.ref_rows += take.shape[0]
        if t.ref_rows >= self.config.reference_rows:
            t.ref_mean = t.ref_sum / t.ref_rows
            t.ref_var = np.maximum(t.ref_sq / t.ref_rows - t.ref_mean**2, 0.0)

    def _tags(self, rows: Any, norms: np.ndarray, key: str) -> None:
        if not rows.tags:
            return
        offsets = rows.offsets
        finite = np.isfinite(norms)
        counted = None
        if not finite.all():  # non-finite rows: in no tag's figures
            norms = np.where(finite, norms, 0.0)
            counted = np.concatenate([[0], np.cumsum(finite)])
        for i in range(len(rows.request_ids)):
            a, b = int(offsets[i]), int(offsets[i + 1])
            n = b - a if counted is None else int(counted[b] - counted[a])
            if n == 0:
                continue
            for k, v in sorted(rows.request_tags(i).items()):
                label = f"{k}={v}"
                if label not in self.tags and len(self.tags) >= self.config.max_tag_values:
                    self.tag_overflow_rows += n
                    label = OTHER_TAG
                acc = self.tags.setdefault(label, {}).setdefault(key, [0, 0.0])
                acc[0] += n
                acc[1] += float(norms[a:b].sum())

    def snapshot(self) -> dict[str, Any]:
        """Every figure, JSON-able; ``taps`` sorted by layer then hook."""
        taps: dict[str, Any] = {}
        for key, t in sorted(self.taps.items(), key=lambda kv: (kv[1].layer, kv[1].hook)):
            taps[key] = self._tap_snapshot(t)
        tags = {
            label: {
                k: {"rows": int(r), "norm_mean": s / r if r else 0.0} for k, (r, s) in v.items()
            }
            for label, v in sorted(self.tags.items())
        }
        return {
            "messages": self.messages,
            "rows": self.rows,
            "bytes": self.bytes,
            "steps_counted": self.steps_counted,
            "last_step": self.last_step,
            "tokens": max((t.rows for t in self.taps.values()), default=0),
            "taps": taps,
            "tags": tags,
            "tag_overflow_rows": self.tag_overflow_rows,
            "nonfinite_rows": self.nonfinite_rows,
        }

    def _tap_snapshot(self, t: _Tap) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": t.layer, "hook": t.hook, "hidden": t.hidden}
        out.update(rows=t.rows, batches=t.batches, nonfinite_rows=t.nonfinite)
        norms = np.concatenate(list(t.norms)) if t.norms else np.zeros(0)
        if len(norms):
            counts, edges = np.histogram(norms, bins=self.config.bins)
            out.update(
                norm_mean=float(norms.mean()),
                norm_std=float(norms.std()),
                norm_p50=float(np.median(norms)),
                norm_max=float(norms.max()),
                norm_hist={"counts": counts.tolist(), "edges": edges.tolist()},
            )
        if t.outliers:
            out["outlier_frac"] = float(np.mean(t.outliers))
        if t.m1 is None or t.m2 is None:
            return out
        mean, var = t.m1, np.maximum(t.m2 - t.m1**2, 0.0)
        out.update(act_mean=float(mean.mean()), act_var=float(var.mean()))
        if t.ref_mean is not None and t.ref_var is not None:
            ref_norm = float(np.linalg.norm(t.ref_mean))
            scale = math.sqrt(float(t.ref_var.sum())) or 1.0
            # Relative to the reference's mean or spread, whichever is larger: a
            # figure comparable across layers whose scales differ by orders.
            out["mean_drift"] = float(np.linalg.norm(mean - t.ref_mean)) / max(ref_norm, scale)
            ref_v = float(t.ref_var.mean())
            out["var_drift"] = float(var.mean()) / ref_v - 1.0 if ref_v > 0 else 0.0
        return out


@dataclass
class _Seq:
    request_id: str
    sample_index: int
    tags: dict[str, Any]
    rows: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=dict)
    """tap -> chunks of (positions, token ids, norms), in arrival order"""
    kept: dict[str, int] = field(default_factory=dict)
    """tap -> rows held in ``rows`` (capped at ``max_positions``)"""
    ended: str = ""
    updated: float = 0.0


class RecentRequests:
    """Per-token norms of the last ``keep`` requests (sampled steps only), per tap."""

    def __init__(self, keep: int = 16, max_positions: int = 4096) -> None:
        if keep < 1:
            raise ValueError(f"RecentRequests.keep: must be >= 1, got {keep}")
        self.keep = keep
        self.max_positions = max_positions
        self._seqs: OrderedDict[tuple[str, int], _Seq] = OrderedDict()
        self.forgotten = 0

    def add(self, batches: Sequence[Batch], norms: Sequence[np.ndarray]) -> None:
        """Batches in arrival order, with their per-row norms (``ActivationStats.add``).

        Rows are grouped by (request, tap) with numpy, so the Python work is per
        request seen, not per request per message."""
        if not batches:
            return
        now = time.time()
        keys: list[tuple[str, int]] = []  # every request seen, by code
        where: list[tuple[int, int]] = []  # its first (message, request): its tags
        code_of: dict[tuple[str, int], int] = {}
        taps: dict[str, int] = {}
        seg_code: list[int] = []  # per (message, request)
        msg_tap, msg_reqs, seg_rows, pos, tok, nrm = [], [], [], [], [], []
        for i, b in enumerate(batches):
            rows = b.header.rows
            rids = rows.request_ids
            if not rids:
                continue
            ks = list(zip(rids, rows.sample_index or itertools.repeat(0), strict=False))
            for j, k in enumerate(ks):
                if k not in code_of:
                    code_of[k] = len(keys)
                    keys.append(k)
                    where.append((i, j))
            seg_code.extend(map(code_of.__getitem__, ks))
            msg_tap.append(taps.setdefault(point_key(b.header.layer, b.header.hook), len(taps)))
            msg_reqs.append(len(ks))
            o = rows.offsets
            seg_rows.append(o[1:] - o[:-1])
            pos.append(rows.positions)
            tok.append(rows.token_ids)
            nrm.append(norms[i])
        if keys:
            self._store(
                np.array(seg_code, dtype=np.int64),
                np.repeat(np.array(msg_tap, dtype=np.int64), msg_reqs),
                np.concatenate(seg_rows),
                (np.concatenate(pos), np.concatenate(tok), np.concatenate(nrm)),
                keys,
                [batches[i].header.rows.request_tags(j) for i, j in where],
                list(taps),
                now,
            )
        for b in batches:
            for e in b.header.ended:
                s = self._seqs.get((e.request_id, e.sample_index))
                if s is not None:
                    s.ended = e.reason

    def _store(
        self,
        seg_code: np.ndarray,
        seg_tap: np.ndarray,
        seg_rows: np.ndarray,
        cols: tuple[np.ndarray, np.ndarray, np.ndarray],
        keys: list[tuple[str, int]],
        tags: list[dict[str, Any]],
        tap_names: list[str],
        now: float,
    ) -> None:
        live = seg_rows > 0  # a request without rows in a message is not "seen" in it
        if not live.any():
            return
        # Requests in the order they were last seen: the newest ends up newest.
        codes, last = _last_occurrences(seg_code[live])
        seqs = {}
        for c in codes[np.argsort(last)].tolist():
            rid, index = keys[c]
            seqs[c] = self._seq(rid, index, tags[c])
            seqs[c].updated = now
        # Rows grouped by (request, tap), arrival order kept within a group.
        group = np.repeat(seg_code * len(tap_names) + seg_tap, seg_rows)
        order = np.argsort(group, kind="stable")
        bounds = np.flatnonzero(np.diff(group[order])) + 1
        for rows in np.split(order, bounds):
            g = int(group[rows[0]])
            s = seqs[g // len(tap_names)]
            if (s.request_id, s.sample_index) not in self._seqs:
                continue  # forgotten within this very update
            tap = tap_names[g % len(tap_names)]
            room = self.max_positions - s.kept.get(tap, 0)
            if room <= 0:
                continue
            rows = rows[:room]
            s.rows.setdefault(tap, []).append(tuple(c[rows] for c in cols))
            s.kept[tap] = s.kept.get(tap, 0) + len(rows)

    def _seq(self, rid: str, index: int, tags: dict[str, Any]) -> _Seq:
        k = (rid, index)
        s = self._seqs.get(k)
        if s is None:
            s = self._seqs[k] = _Seq(rid, index, dict(tags))
            while len(self._seqs) > self.keep:
                self._seqs.popitem(last=False)
                self.forgotten += 1
        else:
            self._seqs.move_to_end(k)
        return s

    def snapshot(self, tap: str | None) -> list[dict[str, Any]]:
        """Newest first; per-token norms of ``tap`` only (None: no per-token data).
        A position seen twice (a preempted request computed again) shows its last."""
        out = []
        for s in reversed(self._seqs.values()):
            chunks = s.rows.get(tap, []) if tap else []
            pos = tok = nrm = np.zeros(0)
            if chunks:
                p, t, n = (np.concatenate(c) for c in zip(*chunks, strict=True))
                pos, last = _last_occurrences(p)  # a position seen twice: its last row
                tok, nrm = t[last], n[last]
            out.append(
                {
                    "request_id": s.request_id,
                    "sample_index": s.sample_index,
                    "tags": s.tags,
                    "ended": s.ended,
                    "updated": s.updated,
                    "taps": sorted(s.rows),
                    "positions": pos.astype(np.int64).tolist(),
                    "token_ids": tok.astype(np.int64).tolist(),
                    "norms": nrm.astype(np.float64).tolist(),
                }
            )
        return out


def _last_occurrences(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``a`` (sorted) and the index of each one's last occurrence."""
    values, first_in_reversed = np.unique(a[::-1], return_index=True)
    return values, len(a) - 1 - first_in_reversed


class BusHealth:
    """Rates and totals from successive ``Publisher.stats()`` snapshots."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = ignore
        self._prev: tuple[float, dict[str, Any]] | None = None
        self.latest: dict[str, Any] = {}

    def update(
        self, stats: dict[str, Any], now: float | None = None, tokens: int = 0, every: int = 1
    ) -> dict[str, Any]:
        """Digest one snapshot. ``tokens`` is the rows this consumer received of its
        busiest tap and ``every`` its sampling period: tokens/s is estimated from them
        where the publisher does not count tokens itself (``stats["tokens"]``)."""
        now = time.monotonic() if now is None else now
        subs = {k: v for k, v in (stats.get("subscribers") or {}).items() if k not in self.ignore}
        subs = {k: v for k, v in subs.items() if v.get("name") not in self.ignore}
        drops: Counter[str] = Counter()
        for v in subs.values():
            drops.update(v.get("dropped") or {})
        bytes_sent = sum(int(v.get("bytes_sent", 0)) for v in subs.values())
        out: dict[str, Any] = {
            "published": int(stats.get("published", 0)),
            "last_step": int(stats.get("last_step", -1)),
            "source_drops": int(stats.get("source_drops", 0)),
            "queued": int(stats.get("queued", 0)),
            "queued_bytes": int(stats.get("queued_bytes", 0)),
            "stall_s": float(stats.get("stall_s", 0.0)),
            "capture_s": float(stats.get("capture_s", 0.0)),
            "publisher_cpu_s": float(stats.get("publisher_cpu_s", 0.0)),
            "latency_p50_ms": float((stats.get("latency") or {}).get("p50_ms", 0.0)),
            "latency_p99_ms": float((stats.get("latency") or {}).get("p99_ms", 0.0)),
            "subscribers": len(subs),
            "drops": dict(sorted(drops.items())),
            "drops_total": sum(drops.values()) + int(stats.get("source_drops", 0)),
            "spill_bytes": sum(int(v.get("spill_bytes", 0)) for v in subs.values()),
            "bytes_sent": bytes_sent,
            "lag_steps": {k: int(v.get("lag_steps", 0)) for k, v in sorted(subs.items())},
            "sub_dropped": {k: sum((v.get("dropped") or {}).values()) for k, v in subs.items()},
            "steps_per_s": 0.0,
            "messages_per_s": 0.0,
            "bytes_per_s": 0.0,
            "tokens_per_s": 0.0,
            "capture_frac": 0.0,
            "publisher_cpu_frac": 0.0,
        }
        # Tokens: the engine's own count when the publisher has one; else estimated
        # from the rows this consumer sampled.
        counted = "tokens" in stats
        out["tokens"] = int(stats["tokens"]) if counted else tokens * every
        out["tokens_counted"] = counted
        if self._prev is not None:
            t0, p = self._prev
            dt = now - t0
            if dt > 0:
                steps = out["last_step"] - p["last_step"]
                out["steps_per_s"] = max(0, steps) / dt
                out["messages_per_s"] = max(0, out["published"] - p["published"]) / dt
                # Departed subscribers take their bytes with them: never a negative rate.
                out["bytes_per_s"] = max(0, bytes_sent - p["bytes_sent"]) / dt
                out["tokens_per_s"] = max(0, out["tokens"] - p["tokens"]) / dt
                # What actbus costs the engine: its thread's time in capture, and the
                # publisher thread's CPU beside it, as shares of the interval.
                out["capture_frac"] = max(0.0, out["capture_s"] - p["capture_s"]) / dt
                out["publisher_cpu_frac"] = (
                    max(0.0, out["publisher_cpu_s"] - p["publisher_cpu_s"]) / dt
                )
        self._prev = (now, out)
        self.latest = out
        return out
