"""The ``actbus`` command.

actbus run --list
actbus run NAME --connect ADDR [--policy P] [--window N] [consumer flags...]
actbus stats --connect ADDR [--once | --json]
actbus dashboard --connect ADDR [--port P]
actbus serve MODEL [--layers L] [--hooks H] [--publish ADDR] [vllm serve args...]
actbus replay RUN_DIR --publish ADDR [--rate STEPS_PER_S]
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
from actbus.bus import POLICIES, SubscriptionRejected, statsview
from actbus.bus.protocol import parse_match, parse_policy
from actbus.bus.security import ClientAuth
from actbus.config import ConfigError

TRAINERS = "actbus.trainers"  # entry points: main(argv) -> exit code (trainers/cli.py)


def consumer_command(name: str, address: str, *flags: str) -> list[str]:
    """The argv that starts consumer ``name`` as its own process, as a user would."""
    return [sys.executable, "-m", "actbus.cli", "run", name, "--connect", address, *flags]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # everything after the model goes to vLLM untouched
        from actbus.serve import main as serve_main

        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="actbus", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run a consumer plugin against a publisher", add_help=False)
    run_p.add_argument("name", nargs="?", help="consumer name (see --list)")
    run_p.add_argument("--list", action="store_true", help="list installed consumers")
    run_p.add_argument("-h", "--help", action="store_true")
    sub.add_parser("serve", help="start vLLM's OpenAI server with capture (see serve -h)")
    keys_p = sub.add_parser(
        "keys",
        help="make CURVE keys: a publisher keypair and one per subscriber",
        description="Write ZeroMQ CURVE certificates into DIR: the publisher's keypair (once) "
        "and a subscriber keypair named by --client, whose public key goes into "
        "DIR/authorized_keys. Run again with another --client for each further subscriber.",
    )
    keys_p.add_argument("dir", help="directory for the key files (made if missing, mode 0700)")
    keys_p.add_argument("--client", default="client", help="subscriber key name (default client)")
    stats_p = sub.add_parser("stats", help="the publisher's counters: a live table (--once: one)")
    statsview.add_arguments(stats_p)
    dash_p = sub.add_parser(
        "dashboard", help="a live web view of the bus and its activations, on 127.0.0.1"
    )
    from consumers import dashboard

    dashboard.add_arguments(dash_p)
    replay_p = sub.add_parser("replay", help="publish a stored run (fs-sink) back on the bus")
    from actbus import replay as replay_mod

    replay_mod.add_arguments(replay_p)
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        return _run(args, rest, run_p)
    if args.command == "keys":
        if rest:
            keys_p.error(f"unrecognized arguments: {' '.join(rest)}")
        return _keys(args.dir, args.client)
    if args.command == "replay":
        if rest:
            replay_p.error(f"unrecognized arguments: {' '.join(rest)}")
        return replay_mod.main(args)
    if args.command == "stats":
        if rest:
            stats_p.error(f"unrecognized arguments: {' '.join(rest)}")
        return statsview.main(args)
    if args.command == "dashboard":
        if rest:
            dash_p.error(f"unrecognized arguments: {' '.join(rest)}")
        return dashboard.main(args, dash_p)
    parser.error(f"unknown command {args.command}")
    return 2


def _keys(directory: str, client: str) -> int:
    from actbus.bus.security import generate_keys

    try:
        k = generate_keys(directory, client)
    except ConfigError as e:
        print(f"actbus keys: {e}", file=sys.stderr)
        return 2
    print(
        f"""CURVE keys in {directory} (secret files are mode 0600; never copy a secret off its host)
  publisher:   {k.server_secret}    secret, stays on the publisher host
               {k.authorized_keys}/   public keys of the subscribers it lets in
  subscribers: {k.server_public}           public, copy to every subscriber host
               {k.client_secret}    secret, copy to the host of subscriber {client!r} only

publisher (vLLM additional_config):
  {{"actbus": {{"publish": "tcp://0.0.0.0:5555", "layers": [...],
              "server_secret_key": "{k.server_secret}",
              "authorized_keys": "{k.authorized_keys}"}}}}
subscriber:
  actbus run NAME --connect tcp://PUBLISHER_HOST:5555 \\
      --server-key {k.server_public} --client-secret-key {k.client_secret}
another subscriber: actbus keys {directory} --client NAME2"""
    )
    return 0


def _run(args: argparse.Namespace, rest: list[str], run_p: argparse.ArgumentParser) -> int:
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
    p = argparse.ArgumentParser(prog=f"actbus run {args.name}")
    p.add_argument(
        "--connect", required=True, help="publisher address, e.g. ipc:///tmp/actbus.sock"
    )
    p.add_argument(
        "--policy",
        default=cls.default_policy,
        help=f"what the publisher does when this consumer falls behind: {', '.join(POLICIES)} "
        f"(as sample:N, sample:FRACTION or sample:R/s, spill:MB:FALLBACK); "
        f"default {cls.default_policy}",
    )
    p.add_argument(
        "--tags",
        default=None,
        help='keep only requests with these tags, as JSON: \'{"split": "train"}\'; '
        'a list accepts any of its values: \'{"lang": ["en", "fr"]}\'',
    )
    p.add_argument(
        "--group",
        default="",
        help="share the stream with the other subscribers of this group, each message "
        "going to one of them (load-balanced); default: receive everything",
    )
    p.add_argument("--window", type=int, default=64, help="credit: messages in flight")
    p.add_argument("--window-mb", type=float, default=128, help="credit: MiB in flight")
    p.add_argument("--exit-on-end", action="store_true", help="exit when the publisher stops")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--on-error",
        choices=consumers.ON_ERROR,
        default="stop",
        help="when the consumer raises: stop (exit 1, the default) or restart it with a "
        "fresh subscription; the publisher is not affected either way",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help=f"with --on-error restart: give up (exit 1) after N restarts "
        f"(default {consumers.RestartPolicy.max_restarts})",
    )
    p.add_argument(
        "--server-key", default=None, help="CURVE: the publisher's public key file (server.key)"
    )
    p.add_argument(
        "--client-secret-key",
        default=None,
        help="CURVE: this subscriber's secret key file (NAME.key_secret from `actbus keys`)",
    )
    cls.add_arguments(p)
    if args.help:
        p.print_help()
        return 0
    opts = p.parse_args(rest)
    try:
        parse_policy(opts.policy)
    except ValueError as e:
        p.error(f"--policy: {e}")
    try:
        tags = parse_match(opts.tags) if opts.tags else None
    except ValueError as e:
        p.error(f"--tags: {e}")
    if opts.window < 1:
        p.error(f"--window must be at least 1 (messages in flight), got {opts.window}")
    if opts.window_mb <= 0:
        p.error(f"--window-mb must be above 0 (MiB in flight), got {opts.window_mb}")
    logging.basicConfig(
        level=opts.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if opts.max_restarts is not None and opts.on_error != "restart":
        p.error("--max-restarts applies only with --on-error restart")
    if opts.max_restarts is not None and opts.max_restarts < 0:
        p.error(f"--max-restarts must be 0 or more, got {opts.max_restarts}")
    restart = consumers.RestartPolicy(on_error=opts.on_error)
    if opts.max_restarts is not None:
        restart = dataclasses.replace(restart, max_restarts=opts.max_restarts)
    try:  # checked here so the error names the flags
        ClientAuth(
            opts.connect,
            server_key=opts.server_key,
            client_secret_key=opts.client_secret_key,
            fields=("--server-key", "--client-secret-key"),
        )
    except ConfigError as e:
        p.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        out = consumers.run(
            functools.partial(cls.from_args, opts),
            opts.connect,
            subscription=lambda consumer: consumer.subscription(
                policy=opts.policy,
                window=opts.window,
                window_bytes=int(opts.window_mb * (1 << 20)),
                match=tags,
                group=opts.group,
            ),
            restart=restart,
            stop=stop,
            exit_on_end=opts.exit_on_end,
            server_key=opts.server_key,
            client_secret_key=opts.client_secret_key,
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
    if out.failure is not None:
        hint = (
            f"gave up after {out.restarts} restarts (--max-restarts)"
            if opts.on_error == "restart"
            else "stopped (--on-error stop; --on-error restart restarts it)"
        )
        print(f"actbus run {args.name}: {out.failure}; {hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
