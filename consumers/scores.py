"""Monitor scores for the dashboards: live figures per monitor, per tag, per request.

``ScoreStats`` digests the per-request ``Scores`` a dashboard reads off its score
subscription (``actbus.monitor.reader.split_scores``) into figures per series (one
monitor at one layer) and per column (a probe has one; an SAE monitor one per
feature): the rows scored and their mean since the start; over the last
``window_rows`` rows the mean, p90, max and the share above the monitor's threshold
(0.5 after a sigmoid, else 0: a linear probe's positive side, an SAE feature that
fires); the mean of each column per ``key=value`` tag; and the per-token scores of
the last requests. Every figure is bounded whatever peers send: columns past
``max_columns``, series past ``max_series``, tag labels past ``max_tag_values``
(counted under ``(other)``), requests past ``keep_requests`` and positions past
``max_positions`` are left out and counted. A row holding a NaN or an infinity is
counted and kept out of every other figure. Snapshots are plain JSON-able dicts, so
the web page and the W&B logger show the same numbers.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actbus.monitor.reader import Scores
from actbus.wire import RequestEnd
from consumers.stats import OTHER_TAG


@dataclass(frozen=True)
class ScoreStatsConfig:
    """How monitor scores are summarised, and how much of them is kept."""

    window_rows: int = 4096
    """Rows per series the recent mean, p90, max and above-threshold share are over."""
    max_columns: int = 8
    """Columns per series summarised (an SAE monitor may score thousands of features)."""
    max_series: int = 64
    """(monitor, layer) series tracked; rows of more are counted, not summarised."""
    max_tag_values: int = 64
    """Distinct ``key=value`` tag labels tracked; the rest go to ``(other)`` (counted)."""
    keep_requests: int = 16
    """Recent requests whose per-token scores are kept (0: none, as for W&B)."""
    max_positions: int = 512
    """Per-token scores kept per recent request and series (the first ones)."""
    request_columns: int = 4
    """Columns of each series kept per token for recent requests."""

    def __post_init__(self) -> None:
        for name in ("window_rows", "max_columns", "max_series", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"ScoreStatsConfig.{name}: must be >= 1, got {getattr(self, name)}"
                )
        for name in ("max_tag_values", "keep_requests", "request_columns"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"ScoreStatsConfig.{name}: must be >= 0, got {getattr(self, name)}"
                )


def series_key(monitor: str, layer: int) -> str:
    return f"{monitor}@{layer}"


def threshold_of(activation: str) -> float:
    """Where a score counts as "on": 0.5 for a probability, 0 for anything else."""
    return 0.5 if activation == "sigmoid" else 0.0


@dataclass
class _Series:
    monitor: str
    layer: int
    hook: str
    width: int
    labels: tuple[int, ...]
    cols: int
    version: int = 0
    rows: int = 0
    nonfinite: int = 0
    messages: int = 0
    sums: np.ndarray = field(default_factory=lambda: np.zeros(0))
    window: deque[np.ndarray] = field(default_factory=deque)
    held: int = 0


@dataclass
class _Request:
    tags: dict[str, Any]
    series: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    """series key -> chunks of (positions, values [rows, request_columns])"""
    kept: dict[str, int] = field(default_factory=dict)
    ended: str = ""
    updated: float = 0.0


class ScoreStats:
    """Bounded live figures of the monitor scores a dashboard receives."""

    def __init__(self, config: ScoreStatsConfig | None = None) -> None:
        self.config = config or ScoreStatsConfig()
        self.monitors: dict[str, dict[str, Any]] = {}
        """What the publisher's WELCOME says of each monitor (kind, activation)."""
        self.series: dict[tuple[str, int], _Series] = {}
        self.tags: dict[str, dict[str, list[Any]]] = {}  # label -> series -> [rows, sums]
        self.tag_overflow_rows = 0
        self.series_overflow_rows = 0
        self.messages = 0
        self._requests: OrderedDict[tuple[str, int], _Request] = OrderedDict()
        self.requests_forgotten = 0

    def describe(self, monitors: Any) -> None:
        """The WELCOME's ``monitors`` entry (name -> kind, activation, ...): untrusted,
        so only string fields of bounded size are kept."""
        if not isinstance(monitors, dict):
            return
        for name, m in list(monitors.items())[: self.config.max_series]:
            if isinstance(name, str) and isinstance(m, dict):
                self.monitors[name] = {
                    k: m[k][:32] for k in ("kind", "activation") if isinstance(m.get(k), str)
                }

    def add(self, scores: Sequence[Scores], ended: Iterable[RequestEnd] = ()) -> None:
        """One message's scores (per request) and the requests that ended with it."""
        now = time.time()
        seen: set[tuple[str, int]] = set()
        for s in scores:
            key = (s.monitor, s.layer)
            ser = self.series.get(key)
            if ser is None:
                if len(self.series) >= self.config.max_series:
                    self.series_overflow_rows += len(s.values)
                    continue
                width = int(s.values.shape[1])
                cols = min(width, self.config.max_columns)
                ser = self.series[key] = _Series(
                    s.monitor, s.layer, s.hook, width, tuple(s.labels), cols, sums=np.zeros(cols)
                )
            if key not in seen:
                ser.messages += 1
                seen.add(key)
            ser.version = max(ser.version, s.version)
            v = np.asarray(s.values[:, : ser.cols], dtype=np.float32)
            if v.ndim != 2 or v.shape[1] != ser.cols:  # a width the series did not start with
                ser.nonfinite += len(v)
                continue
            finite = np.isfinite(v).all(axis=1)
            if not finite.all():
                ser.nonfinite += int((~finite).sum())
                v = v[finite]
            positions = np.asarray(s.positions)[finite]
            if not len(v):
                continue
            ser.rows += len(v)
            ser.sums += v.sum(axis=0, dtype=np.float64)
            self._window(ser, v)
            skey = series_key(s.monitor, s.layer)
            self._tag(s.tags, skey, v)
            self._request(s, skey, positions, v, now)
        self.messages += 1 if scores else 0
        for e in ended:
            r = self._requests.get((e.request_id, e.sample_index))
            if r is not None:
                r.ended = e.reason

    def _window(self, ser: _Series, v: np.ndarray) -> None:
        ser.window.append(v)
        ser.held += len(v)
        cap = self.config.window_rows
        while ser.held - len(ser.window[0]) >= cap:
            ser.held -= len(ser.window.popleft())
        if ser.held > cap:  # the oldest chunk in part
            ser.window[0] = ser.window[0][ser.held - cap :]
            ser.held = cap

    def _tag(self, tags: dict[str, Any], skey: str, v: np.ndarray) -> None:
        for k, val in sorted(tags.items()):
            label = f"{k}={val}"
            if label not in self.tags and len(self.tags) >= self.config.max_tag_values:
                self.tag_overflow_rows += len(v)
                label = OTHER_TAG
            acc = self.tags.setdefault(label, {}).setdefault(skey, [0, np.zeros(v.shape[1])])
            acc[0] += len(v)
            acc[1] += v.sum(axis=0, dtype=np.float64)

    def _request(
        self, s: Scores, skey: str, positions: np.ndarray, v: np.ndarray, now: float
    ) -> None:
        if self.config.keep_requests == 0:
            return
        k = (s.request_id, s.sample_index)
        r = self._requests.get(k)
        if r is None:
            r = self._requests[k] = _Request(dict(s.tags))
            while len(self._requests) > self.config.keep_requests:
                self._requests.popitem(last=False)
                self.requests_forgotten += 1
        else:
            self._requests.move_to_end(k)
        r.updated = now
        room = self.config.max_positions - r.kept.get(skey, 0)
        if room <= 0:
            return
        chunk = (positions[:room].astype(np.int64), v[:room, : self.config.request_columns])
        r.series.setdefault(skey, []).append(chunk)
        r.kept[skey] = r.kept.get(skey, 0) + len(chunk[0])

    def snapshot(self) -> dict[str, Any]:
        """Every figure, JSON-able: ``series`` by monitor then layer, ``requests``
        newest first."""
        series: dict[str, Any] = {}
        for (name, layer), ser in sorted(self.series.items()):
            meta = self.monitors.get(name, {})
            activation = meta.get("activation", "")
            threshold = threshold_of(activation)
            recent = np.concatenate(list(ser.window)) if ser.window else np.zeros((0, ser.cols))
            columns = []
            for c in range(ser.cols):
                col: dict[str, Any] = {
                    "label": ser.labels[c] if c < len(ser.labels) else None,
                    "mean": float(ser.sums[c] / ser.rows) if ser.rows else None,
                }
                if len(recent):
                    x = recent[:, c].astype(np.float64)
                    col.update(
                        recent_mean=float(x.mean()),
                        p90=float(np.quantile(x, 0.9)),
                        max=float(x.max()),
                        above=float((x > threshold).mean()),
                    )
                columns.append(col)
            series[series_key(name, layer)] = {
                "monitor": name,
                "layer": layer,
                "hook": ser.hook,
                "kind": meta.get("kind", ""),
                "activation": activation,
                "threshold": threshold,
                "version": ser.version,
                "rows": ser.rows,
                "recent_rows": ser.held,
                "messages": ser.messages,
                "nonfinite_rows": ser.nonfinite,
                "width": ser.width,
                "columns": columns,
            }
        tags = {
            label: {
                skey: {"rows": int(n), "means": (sums / n).tolist() if n else []}
                for skey, (n, sums) in sorted(per.items())
            }
            for label, per in sorted(self.tags.items())
        }
        return {
            "messages": self.messages,
            "series": series,
            "tags": tags,
            "tag_overflow_rows": self.tag_overflow_rows,
            "series_overflow_rows": self.series_overflow_rows,
            "requests": self._requests_snapshot(),
            "requests_forgotten": self.requests_forgotten,
        }

    def _requests_snapshot(self) -> list[dict[str, Any]]:
        out = []
        for (rid, index), r in reversed(self._requests.items()):
            per: dict[str, Any] = {}
            for skey, chunks in sorted(r.series.items()):
                pos = np.concatenate([c[0] for c in chunks])
                val = np.concatenate([c[1] for c in chunks])
                order = np.argsort(pos, kind="stable")
                per[skey] = {
                    "positions": pos[order].tolist(),
                    # One list per column: the page draws each as a sparkline.
                    "values": val[order].T.astype(np.float64).tolist(),
                }
            out.append(
                {
                    "request_id": rid,
                    "sample_index": index,
                    "tags": r.tags,
                    "ended": r.ended,
                    "updated": r.updated,
                    "series": per,
                }
            )
        return out


def add_monitor_scores_argument(parser: Any) -> None:
    """``--monitor-scores`` / ``--no-monitor-scores``, for both dashboards."""
    parser.add_argument(
        "--monitor-scores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when the engine has monitors, also subscribe to their scores (a few bytes "
        "per token, drop_newest: never slows the engine) and show them",
    )
