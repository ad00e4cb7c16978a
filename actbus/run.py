"""``actbus run NAME``: a consumer or trainer plugin, subscribed to a publisher.

    actbus run --list
    actbus run NAME --connect ADDR [--policy P] [--window N] [NAME's own flags...]

Consumers (entry-point group ``actbus.consumers``) are fed by ``actbus.consumer.run``,
which stops or restarts one that raises. Trainers (group ``actbus.trainers``) own
their loop (Lightning's): each is a ``main(argv) -> int`` handed the rest of the line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import sys
import threading
from importlib.metadata import entry_points

from actbus import consumer as consumers
from actbus.bus import SubscriptionRejected
from actbus.bus.options import SubscriberOptions, add_end_arguments
from actbus.flags import HelpFormatter

TRAINERS = "actbus.trainers"  # entry points: main(argv) -> exit code (trainers/cli.py)


def main(argv: list[str]) -> int:
    """run a consumer or trainer plugin against a publisher (--list: the installed ones)"""
    run_p = argparse.ArgumentParser(
        prog="actbus run",
        description="Run a consumer or trainer plugin against a publisher.",
        add_help=False,
    )
    run_p.add_argument("name", nargs="?", help="consumer or trainer name (see --list)")
    run_p.add_argument("--list", action="store_true", help="list installed consumers and trainers")
    run_p.add_argument("-h", "--help", action="store_true", help="show NAME's flags")
    args, rest = run_p.parse_known_args(argv)
    trainers = {ep.name: ep for ep in entry_points(group=TRAINERS)}
    if args.list:
        for name, target in sorted(consumers.available().items()):
            print(f"{name:16s} {target}")
        for name, ep in sorted(trainers.items()):
            print(f"{name:16s} {ep.value} (trainer)")
        return 0
    if not args.name:
        run_p.print_help()
        return 0 if args.help else 2
    if args.name in trainers:  # Lightning owns the loop: see trainers/cli.py
        return int(trainers[args.name].load()(rest + (["-h"] if args.help else [])) or 0)
    try:
        cls = consumers.load(args.name)
    except (KeyError, TypeError) as e:
        print(f"actbus run: {e.args[0]}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(
        prog=f"actbus run {args.name}",
        description=(cls.__doc__ or "").strip().split("\n\n")[0] or None,
        formatter_class=HelpFormatter,
    )
    SubscriberOptions.add_arguments(
        p.add_argument_group("subscription"),
        exclude=("layers", "hooks"),  # a consumer's own subscription() picks these
        defaults={"policy": cls.default_policy, "name": cls.name},
    )
    r = p.add_argument_group("run")
    add_end_arguments(r)
    r.add_argument("--log-level", default="INFO", help="logging level")
    r.add_argument(
        "--on-error",
        choices=consumers.ON_ERROR,
        default="stop",
        help="when the consumer raises: stop (exit 1) or restart it with a fresh "
        "subscription; the publisher is not affected either way",
    )
    r.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help=f"with --on-error restart: give up (exit 1) after N restarts "
        f"(default {consumers.RestartPolicy.max_restarts})",
    )
    cls.add_arguments(p)
    if args.help:
        p.print_help()
        return 0
    ns = p.parse_args(rest)
    opts = SubscriberOptions.from_args(ns, p)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if ns.max_restarts is not None and ns.on_error != "restart":
        p.error("--max-restarts applies only with --on-error restart")
    if ns.max_restarts is not None and ns.max_restarts < 0:
        p.error(f"--max-restarts must be 0 or more, got {ns.max_restarts}")
    restart = consumers.RestartPolicy(on_error=ns.on_error)
    if ns.max_restarts is not None:
        restart = dataclasses.replace(restart, max_restarts=ns.max_restarts)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        out = consumers.run(
            functools.partial(cls.from_args, ns),
            opts.connect,
            subscription=opts.consumer_subscription,
            restart=restart,
            stop=stop,
            exit_on_end=ns.exit_on_end,
            **opts.keys,
        )
    except SubscriptionRejected as e:
        print(f"actbus run {args.name}: {e}", file=sys.stderr)
        return 1
    logging.getLogger("actbus").info(
        "stopped: received=%d missed=%d rejected=%d errors=%d restarts=%d",
        out.received,
        out.missed,
        out.rejected,
        out.errors,
        out.restarts,
    )
    if len(out.publishers) > 1:  # fan-in: each publisher's own counters
        for addr, row in out.publishers.items():
            logging.getLogger("actbus").info(
                "publisher %s (run %s, dp rank %s): received=%d missed=%d lost=%d rejected=%d",
                addr,
                row.get("publisher_id"),
                row.get("dp_rank"),
                row["received"],
                row["missed"],
                row["lost"],
                row["rejected"],
            )
    if out.failure is not None:
        if ns.on_error == "restart":
            hint = f"gave up after {out.restarts} restarts (--max-restarts)"
        elif out.failure.callback == "construction":  # its flags or its files: a restart
            hint = "it could not start; fix the cause and start it again"  # would fail alike
        else:
            hint = "stopped (--on-error stop; --on-error restart restarts it)"
        print(f"actbus run {args.name}: {out.failure}; {hint}", file=sys.stderr)
        return 1
    return 0
