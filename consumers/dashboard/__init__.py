"""``actbus dashboard``: a local web view of the bus and its activations.

``actbus dashboard --connect ADDR [--port P]`` subscribes with a sampling policy
(``sample:5/s`` by default: it can never slow generation), keeps the same
statistics as the W&B consumer (``consumers.stats``) and serves them on
127.0.0.1 only: one page, no assets from the internet, updated live over
server-sent events. Flags are defined here, without importing the web stack,
so ``actbus --help`` stays quick.
"""

from __future__ import annotations

import argparse

from actbus.bus.protocol import DASHBOARD_POLICY
from consumers.priority import add_priority_arguments

DEFAULT_PORT = 8765


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, help="publisher address")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port on 127.0.0.1 (default {DEFAULT_PORT}; 0: any free port, printed)",
    )
    p.add_argument(
        "--policy",
        default=DASHBOARD_POLICY,
        help=f"subscription policy (default {DASHBOARD_POLICY}): sample:R/s (at most R "
        "steps a second) or sample:N (every N-th step), so the dashboard never slows "
        "generation (a lossless policy would)",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between updates"
    )
    p.add_argument(
        "--requests", type=int, default=16, metavar="N", help="recent requests kept (default 16)"
    )
    p.add_argument(
        "--stale-s",
        type=float,
        default=None,
        metavar="S",
        help="the page says its data is stale after S seconds without an update "
        "(default: 3 x --interval, at least 5)",
    )
    p.add_argument(
        "--slow-client-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a page whose events wait S seconds to be read is dropped (default 10)",
    )
    p.add_argument("--bins", type=int, default=32, help="histogram bins of the per-token norms")
    p.add_argument(
        "--outlier-k",
        type=float,
        default=6.0,
        help="a hidden dimension is an outlier when its peak |x| exceeds K x the RMS "
        "of the median dimension (default 6)",
    )
    add_priority_arguments(p)
    p.add_argument("--server-key", default=None, help="CURVE: the publisher's public key file")
    p.add_argument(
        "--client-secret-key", default=None, help="CURVE: this subscriber's secret key file"
    )
    p.add_argument("--log-level", default="INFO")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from consumers.dashboard.app import serve

    return serve(args, parser)
