"""``actbus stats``: the publisher's counters as a terminal table.

The client is an ordinary subscriber whose subscription wants nothing (no layers),
so it receives no data and, holding nothing, never holds the stream back; it asks
for the counters with a STATS session message and renders the reply with rich.
Under fan-in (``--connect A,B``, a range, ``@FILE``) it asks every publisher and shows
each one's counters under its address, run and data-parallel rank; one that does
not answer is named, and the others are still shown.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from actbus.bus.fanin import FanIn
from actbus.bus.options import SubscriberOptions
from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Event, Subscriber
from actbus.flags import HelpFormatter

CLIENT_NAME = "actbus-stats"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="actbus stats",
        description="The publisher's counters, per subscriber and group: a live table.",
        formatter_class=HelpFormatter,
    )
    SubscriberOptions.add_arguments(p, only=("connect", "server_key", "client_secret_key"))
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.add_argument("--interval", type=float, default=1.0, help="refresh period, seconds")
    p.add_argument("--timeout", type=float, default=10.0, help="give up after this, seconds")
    return p


def stats_subscription() -> Subscription:
    """Wants no layer: no data is ever routed to it."""
    return Subscription(policy="drop_newest", layers=(), window=1, name=CLIENT_NAME)


def request(sub: Subscriber, timeout: float) -> dict[str, Any]:
    """One snapshot of the publisher's counters."""
    sub.request_stats()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        out = sub.recv(timeout=left)
        if isinstance(out, Event) and out.kind == "stats":
            return out.body
    raise TimeoutError(f"no stats from {sub.address} within {timeout}s")


def request_all(sub: FanIn, timeout: float) -> dict[str, dict[str, Any]]:
    """One snapshot of each publisher's counters, by address (with its ``publisher_id``
    and ``dp_rank``); a publisher that does not answer within ``timeout`` is left out."""
    sub.request_stats()
    out: dict[str, dict[str, Any]] = {}
    want = {a for a, s in sub.publishers.items() if s.welcome is not None}
    deadline = time.monotonic() + timeout
    while want - set(out) and (left := deadline - time.monotonic()) > 0:
        ev = sub.recv(timeout=left)
        if isinstance(ev, Event) and ev.kind == "stats" and ev.source is not None:
            src = ev.source
            out[src.address] = {
                **ev.body,
                "publisher_id": src.publisher_id,
                "dp_rank": src.dp_rank,
            }
    return {a: out[a] for a in sub.publishers if a in out}


def render_all(snaps: dict[str, dict[str, Any]], silent: list[str]) -> Group:
    """Each publisher's counters under a line naming it; those that did not answer."""
    parts: list[Any] = []
    for addr, snap in snaps.items():
        rank = "" if snap.get("dp_rank") is None else f"  dp rank {snap['dp_rank']}"
        parts.append(Text(f"publisher {addr}  run {snap.get('publisher_id')}{rank}", "bold"))
        parts.append(render(snap))
    for addr in silent:
        parts.append(Text(f"publisher {addr}: no answer", "red"))
    return Group(*parts)


def render(stats: dict[str, Any]) -> Group:
    lat = stats.get("latency") or {}
    head = Text(
        f"published {stats.get('published', 0)}  last step {stats.get('last_step', -1)}  "
        f"dropped at source {stats.get('source_drops', 0)}  "
        f"queued {stats.get('queued', 0)} ({stats.get('queued_bytes', 0) / 2**20:.1f} MiB)  "
        f"engine stalled {stats.get('stall_s', 0.0):.2f} s  "
        f"capture->send p50 {lat.get('p50_ms', 0.0):.2f} ms p99 {lat.get('p99_ms', 0.0):.2f} ms  "
        f"rejected {stats.get('rejected', 0)}"
    )
    t = Table(title="subscribers", title_justify="left")
    for col in ("name", "policy", "group", "routed", "sent", "MiB sent", "dropped"):
        t.add_column(
            col, justify="left" if col in ("name", "policy", "group", "dropped") else "right"
        )
    for col in ("spilled", "replayed", "spill MiB", "queue", "in flight", "lag steps"):
        t.add_column(col, justify="right")
    for key, s in sorted((stats.get("subscribers") or {}).items()):
        if s.get("name") == CLIENT_NAME:
            continue
        dropped = " ".join(f"{k}={v}" for k, v in sorted((s.get("dropped") or {}).items()))
        t.add_row(
            key,
            str(s.get("policy", "")),
            str(s.get("group", "")),
            str(s.get("routed", 0)),
            str(s.get("sent", 0)),
            f"{s.get('bytes_sent', 0) / 2**20:.1f}",
            dropped or "-",
            str(s.get("spilled", 0)),
            str(s.get("replayed", 0)),
            f"{s.get('spill_bytes', 0) / 2**20:.1f}",
            str(s.get("queue_depth", 0)),
            str(s.get("inflight", 0)),
            str(s.get("lag_steps", 0)),
        )
    parts: list[Any] = [head, t]
    if stats.get("groups"):
        g = Table(title="groups", title_justify="left")
        for col in ("group", "members", "routed", "sent", "dropped", "lost in flight"):
            g.add_column(col, justify="left" if col == "group" else "right")
        for name, v in sorted(stats["groups"].items()):
            g.add_row(
                name,
                *(str(v.get(k, 0)) for k in ("members", "routed", "sent", "dropped")),
                str(v.get("lost_inflight", 0)),
            )
        parts.append(g)
    return Group(*parts)


def main(argv: list[str]) -> int:
    """the publisher's counters: a live table (--once: one); per publisher under fan-in"""
    p = parser()
    args = p.parse_args(argv)
    opts = SubscriberOptions.from_args(args, p)
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
        console = Console(width=200)
    if opts.endpoints.fan_in:
        return _main_fanin(args, opts, console)
    with Subscriber(opts.connect, stats_subscription(), keepalive=False, **opts.keys) as sub:
        try:
            sub.wait_welcome(args.timeout)
            snap = request(sub, args.timeout)
        except TimeoutError as e:
            console.print(f"actbus stats: {e}", style="red")
            return 1
        return _show(args, console, snap, lambda: request(sub, args.timeout), render)


def _main_fanin(args: argparse.Namespace, opts: SubscriberOptions, console: Console) -> int:
    """Every publisher's counters: ``--json`` gives ``{"publishers": {ADDR: counters}}``."""
    with FanIn(opts.endpoints, stats_subscription(), keepalive=False, **opts.keys) as sub:
        try:
            sub.wait_welcome(args.timeout, every=True)
        except TimeoutError as e:
            if sub.welcome is None:
                console.print(f"actbus stats: {e}", style="red")
                return 1
            console.print(f"actbus stats: {e}; showing the others", style="yellow")

        def snapshot() -> dict[str, Any]:
            snaps = request_all(sub, args.timeout)
            return {"publishers": snaps, "silent": [a for a in sub.publishers if a not in snaps]}

        return _show(
            args,
            console,
            snapshot(),
            snapshot,
            lambda snap: render_all(snap["publishers"], snap["silent"]),
        )


def _show(
    args: argparse.Namespace,
    console: Console,
    snap: dict[str, Any],
    again: Callable[[], dict[str, Any]],
    draw: Callable[[dict[str, Any]], Group],
) -> int:
    if args.json:
        print(json.dumps(snap, sort_keys=True))
        return 0
    if args.once:
        console.print(draw(snap))
        return 0
    with Live(draw(snap), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(draw(again()), refresh=True)
        except KeyboardInterrupt:
            return 0
        except TimeoutError as e:
            console.print(f"actbus stats: {e}", style="red")
            return 1
