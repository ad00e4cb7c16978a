"""``actbus dashboard``: a local web view of the bus and its activations.

``actbus dashboard --connect ADDR [--port P]`` subscribes with a sampling policy
(``sample:5/s`` by default: it can never slow generation), keeps the same
statistics as the W&B consumer (``consumers.stats``) and serves them on
127.0.0.1 only: one page, no assets from the internet, updated live over
server-sent events. The web stack is imported only when the command runs.
"""

from __future__ import annotations

import argparse

from actbus.bus.options import SubscriberOptions, add_end_arguments
from actbus.bus.protocol import DASHBOARD_POLICY
from actbus.experts import add_expert_load_argument
from actbus.flags import HelpFormatter
from consumers.priority import add_priority_arguments
from consumers.scores import add_monitor_scores_argument

DEFAULT_PORT = 8765


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="actbus dashboard",
        description="A live web view of the bus and its activations, served on 127.0.0.1. "
        f"Its default policy, {DASHBOARD_POLICY}, bounds what watching costs the engine; a "
        "lossless policy would let the dashboard slow generation.",
        formatter_class=HelpFormatter,
    )
    SubscriberOptions.add_arguments(
        p.add_argument_group("subscription"),
        exclude=("layers", "hooks"),
        defaults={"policy": DASHBOARD_POLICY, "name": "dashboard"},
    )
    add_end_arguments(p.add_argument_group("run"))
    d = p.add_argument_group("dashboard")
    d.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port on 127.0.0.1 (0: any free port, printed)",
    )
    d.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between updates"
    )
    d.add_argument("--requests", type=int, default=16, metavar="N", help="recent requests kept")
    d.add_argument(
        "--stale-s",
        type=float,
        default=None,
        metavar="S",
        help="the page says its data is stale after S seconds without an update "
        "(default: 3 x --interval, at least 5)",
    )
    d.add_argument(
        "--slow-client-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a page whose events wait S seconds to be read is dropped (default 10)",
    )
    d.add_argument("--bins", type=int, default=32, help="histogram bins of the per-token norms")
    d.add_argument(
        "--outlier-k",
        type=float,
        default=6.0,
        help="a hidden dimension is an outlier when its peak |x| exceeds K x the RMS "
        "of the median dimension",
    )
    add_priority_arguments(d)
    add_monitor_scores_argument(d)
    add_expert_load_argument(d)
    d.add_argument("--log-level", default="INFO", help="logging level")
    return p


def main(argv: list[str]) -> int:
    """a live web view of the bus and its activations, on 127.0.0.1"""
    p = parser()
    args = p.parse_args(argv)
    options = SubscriberOptions.from_args(args, p)
    from consumers.dashboard.app import serve

    return serve(args, options, p)
