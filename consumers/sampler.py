"""The common part of the dashboards: a sampling consumer that keeps statistics.

``DashboardSampler`` holds the batches it receives and, once per report, digests them
into ``ActivationStats`` (and, when asked, ``RecentRequests``). Every
``interval_s`` it asks the publisher for its counters through a second,
data-less connection (the same client ``actbus stats`` uses), so it can hand one
complete snapshot to ``report``: the W&B logger logs it, the web dashboard
serves it. It subscribes with ``sample:5/s`` by default (``DASHBOARD_POLICY``), so
a slow dashboard loses sampled steps (counted by the publisher), never generation time.

When the engine has monitors (its WELCOME lists them) and ``monitor_scores`` is on, it
also subscribes to their scores alone, on a second connection (``NAME-scores``,
``drop_newest``: scores are a few bytes per token, so every one of them comes unless
the dashboard falls a whole window behind, and none can slow the engine), and digests
them into ``ScoreStats`` (``consumers.scores``): the snapshot's ``monitors`` entry.
When the engine taps a mixture-of-experts router (its WELCOME says ``router``) and
``expert_load`` is on, the same connection also takes the ``router`` stream (a few
floats per token) and counts it into ``ExpertLoad`` (``actbus.experts``): the
snapshot's ``experts`` entry, expert load per layer. Dense models: no such entry.
"""

from __future__ import annotations

import argparse
import logging
import time
from abc import abstractmethod
from typing import Any, ClassVar

import torch

from actbus.bus import Batch, Subscriber, statsview
from actbus.bus.endpoints import Endpoints
from actbus.bus.fanin import FanIn, subscribe
from actbus.bus.protocol import DASHBOARD_POLICY, MAX_WINDOW, Subscription
from actbus.consumer import Consumer
from actbus.experts import ExpertLoad, add_expert_load_argument
from actbus.logcap import capped_text
from actbus.monitor.reader import split_scores
from actbus.wire import MONITOR_HOOK, ROUTER_HOOK
from consumers.priority import add_priority_arguments, lower_priority
from consumers.scores import ScoreStats, ScoreStatsConfig, add_monitor_scores_argument
from consumers.stats import ActivationStats, BusHealth, RecentRequests, StatsConfig

log = logging.getLogger("actbus.dashboard")


MAX_PENDING_BYTES = 64 << 20
"""Batches held for the next digest: past this, they are digested at once."""
SCORE_POLICY = "drop_newest"
SCORE_WINDOW_BYTES = 16 << 20
"""Credit of the score subscription: ``MAX_WINDOW`` messages or this many bytes."""
SCORE_DRAIN_S = 0.25
"""Score messages are read at least this often while batches arrive (and at each
heartbeat and report)."""
MAX_DRAIN = 4 * MAX_WINDOW
"""Score messages read in one go, at most: the main stream is never starved."""


class DashboardSampler(Consumer):
    """Statistics of a sampled stream plus the publisher's health, every ``interval_s``."""

    default_policy: ClassVar[str] = DASHBOARD_POLICY

    def __init__(
        self,
        address: str,
        *,
        interval_s: float = 2.0,
        config: StatsConfig | None = None,
        recent: RecentRequests | None = None,
        server_key: str | None = None,
        client_secret_key: str | None = None,
        stats_timeout_s: float = 2.0,
        monitor_scores: bool = True,
        score_config: ScoreStatsConfig | None = None,
        expert_load: bool = True,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0 seconds, got {interval_s}")
        # Batches are small: one thread is plenty, and the engine (often on the same
        # host) keeps the cores that torch's default thread pool would spin on.
        torch.set_num_threads(1)
        self.address = address
        self.interval_s = interval_s
        self.acts = ActivationStats(config)
        self.recent = recent
        self.health = BusHealth(ignore=(statsview.CLIENT_NAME,))
        self.sample_every = 1
        self.sample_per_s = 0.0
        self.welcome: dict[str, Any] = {}
        self.beat: dict[str, Any] = {}
        self.stats_failures = 0
        self.digest_errors = 0
        """Batches left out because the statistics could not take them (logged)."""
        self._keys = (server_key, client_secret_key)
        self._fan_in = Endpoints.parse(address).fan_in
        self._stats_timeout_s = stats_timeout_s
        self._side: Subscriber | None = None
        self._next = time.monotonic() + interval_s
        self._ended = False
        self._pending: list[Batch] = []
        self._pending_bytes = 0
        self.reports = 0
        self.monitor_scores = monitor_scores
        self.scores = ScoreStats(score_config)
        self.scores_error: str | None = None
        self._scores_sub: Subscriber | FanIn | None = None
        self._named: tuple[str, ...] = ()
        """The hooks of the side subscription: monitor scores, router rows, or both."""
        self.expert_load = expert_load
        self.experts: ExpertLoad | None = None
        self.experts_error: str | None = None
        self._match: dict[str, Any] | None = None
        self._drained = 0.0
        self.publishers: dict[str, dict[str, Any]] = {}
        """What this dashboard received from each publisher (by address): its run,
        data-parallel rank, messages, rows and last step; under fan-in a panel each."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--interval",
            type=float,
            default=2.0,
            metavar="S",
            help="seconds between two snapshots (stats asked of the publisher, one report)",
        )
        parser.add_argument(
            "--bins", type=int, default=32, help="histogram bins of the per-token norms"
        )
        add_priority_arguments(parser)
        add_monitor_scores_argument(parser)
        add_expert_load_argument(parser)
        parser.add_argument(
            "--outlier-k",
            type=float,
            default=6.0,
            help="a hidden dimension is an outlier when its peak |x| exceeds K x the RMS "
            "of the median dimension (default 6)",
        )

    @staticmethod
    def common_kwargs(args: argparse.Namespace) -> dict[str, Any]:
        """The ``DashboardSampler`` arguments every subclass takes from ``actbus run`` flags."""
        if args.interval <= 0:
            raise ValueError(f"--interval: must be > 0 seconds, got {args.interval}")
        lower_priority(args.nice, args.sched)  # the main thread, before any other starts
        return {
            "interval_s": args.interval,
            "config": StatsConfig(bins=args.bins, outlier_k=args.outlier_k),
            "server_key": getattr(args, "server_key", None),
            "client_secret_key": getattr(args, "client_secret_key", None),
            "monitor_scores": args.monitor_scores,
            "expert_load": args.expert_load,
        }

    # ----------------------------------------------------------------- callbacks
    def on_welcome(self, info: dict[str, Any]) -> None:
        self.welcome = dict(info)
        named = []
        monitors = info.get("monitors")
        if self.monitor_scores and isinstance(monitors, dict) and monitors:
            self.scores.describe(monitors)
            named.append(MONITOR_HOOK)
        if self.expert_load and self.experts is None and self.experts_error is None:
            try:
                self.experts = ExpertLoad.from_welcome(info)
            except ValueError as e:  # a peer's WELCOME: said, and the rest goes on
                self.experts_error = capped_text(str(e))
                log.error("expert load left out: %s", self.experts_error)
        if self.experts is not None:
            named.append(ROUTER_HOOK)
        if named and self._scores_sub is None and self.scores_error is None:
            self._named = tuple(named)
            self._open_scores()

    def subscription(self, policy: str | None = None, **kw: Any):  # type: ignore[override]
        sub = super().subscription(policy, **kw)
        sampling = sub.policy == "sample"
        self._match = sub.match  # the score subscription keeps the same requests
        self.sample_per_s = sub.sample_per_s if sampling else 0.0
        self.sample_every = sub.sample_every if sampling and not self.sample_per_s else 1
        return sub

    def on_batch(self, batch: Batch) -> None:
        # Held, not digested: one digest per report costs a few numpy calls per tap,
        # where one per message cost tens of them per message (see ActivationStats.add).
        self._pending.append(batch)
        self._pending_bytes += batch.header.nbytes
        self._count_publisher(batch)
        if self._pending_bytes >= MAX_PENDING_BYTES:
            self.digest()
        if time.monotonic() - self._drained >= SCORE_DRAIN_S:
            self.drain_scores()
        self._maybe_report()

    def _count_publisher(self, batch: Batch) -> None:
        src = batch.source
        if src is None:
            return
        p = self.publishers.get(src.address)
        if p is None or p["publisher_id"] != src.publisher_id:  # new, or a new run
            p = self.publishers[src.address] = {"messages": 0, "rows": 0, "last_step": -1}
        p["publisher_id"], p["dp_rank"] = src.publisher_id, src.dp_rank
        p["messages"] += 1
        p["rows"] += batch.header.shape[0]
        p["last_step"] = max(p["last_step"], batch.step)

    def digest(self) -> None:
        """Fold the batches received since the last digest into the statistics.

        Batches the statistics cannot take (a bug, or data no check foresaw) are
        counted and logged, not raised: one bad row must not end the dashboard."""
        if not self._pending:
            return
        batches, self._pending, self._pending_bytes = self._pending, [], 0
        try:
            norms = self.acts.add(batches)
            if self.recent is not None:
                self.recent.add(batches, norms)
        except Exception as e:
            self.digest_errors += len(batches)
            n = self.digest_errors
            if (n - len(batches)).bit_length() < n.bit_length():  # at 1, 2, 4, 8... in all
                log.error(
                    "could not digest %d batches (%d so far); left out: %s",
                    len(batches),
                    n,
                    capped_text(f"{type(e).__name__}: {e}"),
                    exc_info=n == len(batches),  # the traceback once
                )

    def on_heartbeat(self, info: dict[str, Any], caught_up: bool) -> None:
        self.beat = dict(info)
        self.drain_scores()
        self._maybe_report()

    def on_end(self) -> None:
        self._ended = True  # the publisher is gone: no stats to ask for any more
        self.flush()

    def close(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None
        if self._scores_sub is not None:
            self._scores_sub.close()
            self._scores_sub = None

    # ------------------------------------------------------------ monitor scores
    def _open_scores(self) -> None:
        server_key, client_key = self._keys
        sub = Subscription(
            policy=SCORE_POLICY,
            window=MAX_WINDOW,
            window_bytes=SCORE_WINDOW_BYTES,
            hooks=self._named,
            match=self._match,
            name=f"{self.name or 'dashboard'}-scores",
        )
        try:
            self._scores_sub = subscribe(
                self.address, sub, server_key=server_key, client_secret_key=client_key
            )
        except Exception as e:  # the dashboard goes on without scores, and says why
            self._scores_failed(e)

    def drain_scores(self) -> None:
        """Digest the score messages waiting (never blocks)."""
        self._drained = time.monotonic()
        sub = self._scores_sub
        if sub is None:
            return
        try:
            for _ in range(MAX_DRAIN):
                out = sub.recv(timeout=0)
                if out is None:
                    return
                if isinstance(out, Batch) and out.header.hook == MONITOR_HOOK:
                    self._digest_scores(out)
                elif isinstance(out, Batch) and out.header.hook == ROUTER_HOOK:
                    self._digest_router(out)
        except Exception as e:  # the subscription itself failed (refused, closed)
            self._scores_failed(e)

    def _digest_scores(self, batch: Batch) -> None:
        """One message; one the figures cannot take is counted and logged, like a batch
        of activations (``digest``), and the next is read."""
        try:
            self.scores.add(split_scores(batch), batch.header.ended)
        except Exception as e:
            self.digest_errors += 1
            n = self.digest_errors
            if (n - 1).bit_length() < n.bit_length():  # at 1, 2, 4, 8... in all
                log.error(
                    "could not digest a score message (%d so far): %s",
                    n,
                    capped_text(f"{type(e).__name__}: {e}"),
                    exc_info=n == 1,
                )

    def _digest_router(self, batch: Batch) -> None:
        """One message of router rows into the expert load (``ExpertLoad`` refuses, and
        counts, rows that are not ids in range and finite weights)."""
        if self.experts is not None:
            self.experts.add(batch.header.layer, batch.tensor)

    def _scores_failed(self, e: BaseException) -> None:
        self.scores_error = capped_text(f"{type(e).__name__}: {e}")
        log.error("monitor scores left out: %s", self.scores_error)
        if self._scores_sub is not None:
            self._scores_sub.close()
            self._scores_sub = None

    # ------------------------------------------------------------------ reports
    def flush(self) -> dict[str, Any]:
        """Take a snapshot now (publisher counters included if it answers) and report it."""
        snap = self.snapshot()
        self.report(snap)
        self.reports += 1
        self._next = time.monotonic() + self.interval_s
        return snap

    def snapshot(self) -> dict[str, Any]:
        self.digest()
        self.drain_scores()
        stats = self._publisher_stats()
        acts = self.acts.snapshot()
        bus = (
            self.health.update(stats, tokens=acts["tokens"], every=self.sample_every)
            if stats is not None
            else dict(self.health.latest)
        )
        you = self.beat.get("you") or {}
        return {
            "time": time.time(),
            "model": self.welcome.get("model", ""),
            "sample_every": self.sample_every,
            "sample_per_s": self.sample_per_s,
            "bus": bus,
            "bus_ok": stats is not None,
            "stats_failures": self.stats_failures,
            "me": {
                "received": acts["messages"],
                "steps_counted": acts["steps_counted"],
                "routed": int(you.get("routed", 0)),
                "sent": int(you.get("sent", 0)),
                "sampled_out": int(you.get("sampled_out", 0)),
                "dropped": dict(you.get("dropped") or {}),
                "lag_steps": int(you.get("lag_steps", 0)),
                "digest_errors": self.digest_errors,
            },
            "acts": acts,
            "publishers": {a: dict(v) for a, v in self.publishers.items()},
            "monitors": {
                **self.scores.snapshot(),
                "subscribed": self._scores_sub is not None and MONITOR_HOOK in self._named,
                "missed": self._scores_sub.stats.missed if self._scores_sub is not None else 0,
                "error": self.scores_error,
            },
            **self._experts_snapshot(),
        }

    def _experts_snapshot(self) -> dict[str, Any]:
        """``{"experts": ...}`` where the engine taps a router; ``{}`` for a dense model."""
        if self.experts is None and self.experts_error is None:
            return {}
        sub = self._scores_sub
        return {
            "experts": {
                **(self.experts.snapshot() if self.experts is not None else {"layers": {}}),
                "subscribed": sub is not None and ROUTER_HOOK in self._named,
                "missed": sub.stats.missed if sub is not None else 0,
                "error": self.experts_error or self.scores_error,
            }
        }

    @abstractmethod
    def report(self, snap: dict[str, Any]) -> None:
        """Publish one snapshot (log it, serve it)."""

    def _maybe_report(self) -> None:
        if time.monotonic() >= self._next:
            self.flush()

    def _publisher_stats(self) -> dict[str, Any] | None:
        if self._ended or self._fan_in:  # several publishers: their counters are per
            return None  # publisher (`actbus stats --connect ADDR` reads each)
        try:
            if self._side is None:
                server_key, client_key = self._keys
                self._side = Subscriber(
                    self.address,
                    statsview.stats_subscription(),
                    server_key=server_key,
                    client_secret_key=client_key,
                )
                self._side.wait_welcome(self._stats_timeout_s)
            return statsview.request(self._side, self._stats_timeout_s)
        except TimeoutError as e:
            self.stats_failures += 1
            log.warning("no publisher stats (%d so far): %s", self.stats_failures, e)
            return None
