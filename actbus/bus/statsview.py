"""``actbus stats``: the publisher's counters as a terminal table.

The client is an ordinary subscriber whose subscription wants nothing (no layers),
so it receives no data and, holding nothing, never holds the stream back; it asks
for the counters with a STATS session message and renders the reply with rich.
Under fan-in (``--connect A,B``, a range, ``@FILE``) it asks every publisher and shows
each one's counters under its address, run and data-parallel rank; one that does
not answer is named, and the others are still shown.

When the engine taps a mixture-of-experts router (its WELCOME says ``router``), the
live table also shows the expert load per layer (``actbus.experts``): a second
subscription takes the ``router`` stream alone (``drop_newest``: it never holds the
engine back; what it misses is counted) and counts the tokens routed to each expert
since this client connected. ``--once`` and ``--json`` show it with ``--experts-s S``:
they listen that long (less if the publisher ends, or on SIGINT or SIGTERM) before
printing, with the counters as of the window's end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from actbus.bus.fanin import FanIn, subscribe
from actbus.bus.options import SubscriberOptions
from actbus.bus.protocol import MAX_WINDOW, Subscription
from actbus.bus.subscriber import Batch, Event, Subscriber
from actbus.experts import ExpertLoad
from actbus.flags import HelpFormatter
from actbus.logcap import capped_text
from actbus.streams import ROUTER_HOOK

CLIENT_NAME = "actbus-stats"
EXPERTS_NAME = "actbus-stats-experts"
"""The name of the router subscription of ``actbus stats`` (in the publisher's table)."""
EXPERTS_WINDOW_BYTES = 16 << 20
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What ends ``--experts-s`` early, the load counted so far still printed."""
SPARK = " ▁▂▃▄▅▆▇█"
SPARK_WIDTH = 64
"""Characters of a layer's load line: one per expert, or per run of adjacent experts."""
MAX_DEPTH = 32
"""Nesting of a STATS reply kept; deeper is shown as text (the publisher's is 4 deep)."""


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
    p.add_argument(
        "--experts-s",
        type=float,
        default=0.0,
        metavar="S",
        help="with --once or --json, on an engine that taps its MoE router: listen S seconds "
        "to the router stream (less if the publisher ends, or at Ctrl-C) and show the "
        "expert load per layer it carried (the live table shows it without this)",
    )
    return p


def stats_subscription() -> Subscription:
    """Wants no layer: no data is ever routed to it."""
    return Subscription(
        policy="drop_newest", layers=(), window=1, window_bytes=1 << 20, name=CLIENT_NAME
    )


def request(sub: Subscriber, timeout: float) -> dict[str, Any]:
    """One snapshot of the publisher's counters."""
    sub.request_stats()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        out = sub.recv(timeout=left)
        if isinstance(out, Event) and out.kind == "stats":
            return plain(out.body)
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
                **plain(ev.body),
                "publisher_id": src.publisher_id,
                "dp_rank": src.dp_rank,
            }
    return {a: out[a] for a in sub.publishers if a in out}


def plain(value: Any, depth: int = 0) -> Any:
    """A STATS reply as JSON and the table can show it: it is the publisher's msgpack,
    which may hold bytes (shown as hex), bytes keys (as text) and other types (their
    repr, capped), nested past ``MAX_DEPTH`` (as text)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.hex()
    if depth >= MAX_DEPTH:
        return capped_text(repr(value))
    if isinstance(value, dict):
        return {_key(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    return capped_text(repr(value))


def _key(k: Any) -> str:
    return k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k)


def expert_subscription() -> Subscription:
    """The router stream alone, dropped (and counted) rather than waited for."""
    return Subscription(
        policy="drop_newest",
        hooks=(ROUTER_HOOK,),
        window=MAX_WINDOW,
        window_bytes=EXPERTS_WINDOW_BYTES,
        name=EXPERTS_NAME,
    )


class ExpertWatch:
    """The router stream of the publisher(s) at ``connect``, counted per layer."""

    def __init__(self, connect: str, load: ExpertLoad, keys: dict[str, Any]) -> None:
        self.load = load
        self.sub = subscribe(connect, expert_subscription(), **keys)
        self.ended = False
        self.stopped = False
        self.started = time.monotonic()

    def stop(self, *_: Any) -> None:
        self.stopped = True

    def pump(self, seconds: float) -> None:
        """Count what arrives for ``seconds``, or until the publisher ends or ``stop``
        is called (from a signal handler: the message in hand is still counted)."""
        deadline = time.monotonic() + seconds
        while not (self.ended or self.stopped) and (left := deadline - time.monotonic()) > 0:
            out = self.sub.recv(timeout=min(left, 0.25))
            if isinstance(out, Batch) and out.header.hook == ROUTER_HOOK:
                self.load.add(out.header.layer, out.tensor)
            elif isinstance(out, Event) and out.kind == "end":
                self.ended = True

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.load.snapshot(),
            "missed": self.sub.stats.missed,
            "seconds": time.monotonic() - self.started,
        }

    def close(self) -> None:
        self.sub.close()


def open_experts(
    welcome: dict[str, Any] | None, connect: str, keys: dict[str, Any], console: Console
) -> ExpertWatch | None:
    """A watch of the router stream where the WELCOME announces one; None for a dense
    model. A malformed announcement is said, and the counters are still shown."""
    try:
        load = ExpertLoad.from_welcome(welcome)
    except ValueError as e:
        console.print(f"actbus stats: expert load left out: {e}", style="yellow")
        return None
    return None if load is None else ExpertWatch(connect, load, keys)


def render_experts(e: dict[str, Any]) -> Table:
    """Per layer the tokens counted, the imbalance and a line of each expert's load."""
    t = Table(
        title=f"expert load ({e['num_experts']} experts, top {e['top_k']}; tokens routed to "
        f"each in the {e['seconds']:.1f} s it listened; missed {e['missed']} messages, refused "
        f"{e['bad_rows']} rows)",
        title_justify="left",
    )
    for col in ("layer", "tokens", "imbalance", "busiest experts (share)", "load by expert id"):
        t.add_column(col, justify="right" if col in ("tokens", "imbalance") else "left")
    for layer, v in e["layers"].items():
        counts = v["counts"]
        total = sum(counts) or 1
        top = sorted(range(len(counts)), key=lambda i: -counts[i])[:3]
        t.add_row(
            f"L{layer}",
            str(v["tokens"]),
            f"{v['imbalance']:.2f}",
            " ".join(f"{i}:{100 * counts[i] / total:.0f}%" for i in top if counts[i]),
            sparkline(counts),
        )
    return t


def sparkline(counts: list[int]) -> str:
    """One character per expert (per run of adjacent experts past ``SPARK_WIDTH``)."""
    per = -(-len(counts) // SPARK_WIDTH)
    cells = [sum(counts[i : i + per]) for i in range(0, len(counts), per)]
    top = max(cells, default=0) or 1
    return "".join(SPARK[round(c / top * (len(SPARK) - 1))] for c in cells)


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
    experts = stats.get("experts")
    counters = _render_counters(stats)
    return counters if experts is None else Group(counters, render_experts(experts))


def _render_counters(stats: dict[str, Any]) -> Group:
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
    if args.experts_s < 0:
        p.error(f"--experts-s: must be >= 0 seconds, got {args.experts_s}")
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
        return _show(
            args, console, snap, lambda timeout: request(sub, timeout), render, sub.welcome, opts
        )


def _main_fanin(args: argparse.Namespace, opts: SubscriberOptions, console: Console) -> int:
    """Every publisher's counters: ``--json`` gives ``{"publishers": {ADDR: counters}}``
    (and ``experts``: the expert load of them all, where they tap a router)."""
    with FanIn(opts.endpoints, stats_subscription(), keepalive=False, **opts.keys) as sub:
        try:
            sub.wait_welcome(args.timeout, every=True)
        except TimeoutError as e:
            if sub.welcome is None:
                console.print(f"actbus stats: {e}", style="red")
                return 1
            console.print(f"actbus stats: {e}; showing the others", style="yellow")

        def snapshot(timeout: float = args.timeout) -> dict[str, Any]:
            snaps = request_all(sub, timeout)
            return {"publishers": snaps, "silent": [a for a in sub.publishers if a not in snaps]}

        def draw(snap: dict[str, Any]) -> Group:
            out = render_all(snap["publishers"], snap["silent"])
            return out if "experts" not in snap else Group(out, render_experts(snap["experts"]))

        return _show(args, console, snapshot(), snapshot, draw, sub.welcome, opts)


def _show(
    args: argparse.Namespace,
    console: Console,
    snap: dict[str, Any],
    again: Callable[[float], dict[str, Any]],
    draw: Callable[[dict[str, Any]], Group],
    welcome: dict[str, Any] | None,
    opts: SubscriberOptions,
) -> int:
    once = args.json or args.once
    watch = None
    if not once or args.experts_s > 0:
        watch = open_experts(welcome, opts.connect, opts.keys, console)
    try:
        return _show_with(args, console, snap, again, draw, watch)
    finally:
        if watch is not None:
            watch.close()


def listen(
    watch: ExpertWatch,
    seconds: float,
    interval: float,
    again: Callable[[float], dict[str, Any]],
    snap: dict[str, Any],
) -> dict[str, Any]:
    """Count the router stream for ``seconds`` (less if the publisher ends or ``watch``
    is stopped); the publisher's counters as of the window's end. Asked for every
    ``interval`` while it listens: once the publisher has ended it cannot answer, and
    the counters shown beside the load must not be those from before the load came
    (``published 0  last step -1`` over a window of traffic). Each ask waits at most
    ``interval``: a stop (Ctrl-C) while it waits ends the listening that soon, not after
    ``--timeout``."""
    deadline = time.monotonic() + seconds
    while not (watch.ended or watch.stopped) and (left := deadline - time.monotonic()) > 0:
        watch.pump(min(interval, left))
        if not (watch.ended or watch.stopped):
            with contextlib.suppress(TimeoutError):  # kept: the last counters it gave
                snap = again(max(0.1, interval))
    return snap


def _show_with(
    args: argparse.Namespace,
    console: Console,
    snap: dict[str, Any],
    again: Callable[[float], dict[str, Any]],
    draw: Callable[[dict[str, Any]], Group],
    watch: ExpertWatch | None,
) -> int:
    def wait(seconds: float) -> None:
        if watch is None or watch.ended:
            time.sleep(seconds)
        else:
            watch.pump(seconds)

    def full(snap: dict[str, Any]) -> dict[str, Any]:
        return snap if watch is None else {**snap, "experts": watch.snapshot()}

    if args.json or args.once:
        if watch is not None:  # Ctrl-C (or SIGTERM) ends the listening: what came is shown
            handlers = {sig: signal.signal(sig, watch.stop) for sig in STOP_SIGNALS}
            try:
                snap = listen(watch, args.experts_s, args.interval, again, snap)
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
        if args.json:
            print(json.dumps(full(snap), sort_keys=True))
        else:
            console.print(draw(full(snap)))
        return 0
    with Live(draw(full(snap)), console=console, auto_refresh=False) as live:
        try:
            while True:
                wait(args.interval)
                live.update(draw(full(again(args.timeout))), refresh=True)
        except KeyboardInterrupt:
            return 0
        except TimeoutError as e:
            console.print(f"actbus stats: {e}", style="red")
            return 1
