"""``actbus serve``: vLLM's OpenAI-compatible server with the publisher on.

It turns capture flags into vLLM's ``--additional-config``, adds actbus's endpoints
and HTTP calls (``actbus.engine.routes``) as vLLM ``--middleware``, and starts the
server as vLLM itself would; every other argument goes to vLLM unchanged, and the config is
validated the same way as in ``LLM(...)`` before the engine starts.

The server runs as a child process, in a process group of its own, and this one
stays as its supervisor: Ctrl-C, SIGTERM and SIGHUP are passed on to it, once each,
and when it has exited the subscribers are told the stream ended
(``actbus.bus.farewell``). vLLM kills its engine processes at shutdown, so the
capture worker's publisher cannot say so itself; without END, trainers and
``--exit-on-end`` consumers would wait forever. The server can exit before the
engine process it killed has let go of the publisher's address: END waits until it
has (``RELEASE_S`` at most), and a process of the server's still holding it then is
killed (with the server gone, nothing else would stop it), so END comes whatever
order vLLM's processes stop in. Its lifecycle is logged on stderr (actbus's lines only).

Under data parallelism (``--data-parallel-size N``) each rank publishes on its address
of the ``--publish`` template (``{dp_rank}``); ``data_parallel`` reads, with vLLM's own
argument parser, which ranks this server runs, so the END goes to each of them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

from actbus.bus.endpoints import connect_spec
from actbus.config import REQUESTS, CaptureConfig
from actbus.engine.dataparallel import of_args
from actbus.errors import ConfigError
from actbus.flags import HelpFormatter
from actbus.logcap import show_own_logs
from actbus.steer.config import ADMIN_KEY_ENV
from actbus.streams import HOOKS

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
log = logging.getLogger("actbus.serve")


def serve_command(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The vLLM server argv for ``actbus serve`` arguments (raises ConfigError). An admin
    key goes into ``env``, the server's environment, not its argv (which every local
    user can read)."""
    p = argparse.ArgumentParser(
        prog="actbus serve",
        description="Start vLLM's OpenAI-compatible server with actbus capture. "
        "Arguments not listed here are passed to vLLM.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="model path or name, as for vllm serve")
    p.add_argument("--layers", default="all", help="layers to tap: 'all' or e.g. 8,16,24")
    p.add_argument(
        "--hooks", default="post_block", help=f"comma-separated hook points: {', '.join(HOOKS)}"
    )
    p.add_argument("--publish", default=None, help="bus address (default ipc:///tmp/actbus.sock)")
    p.add_argument(
        "--requests",
        default="all",
        choices=REQUESTS,
        help="all: capture every request; selected: only those that set "
        "vllm_xargs={'actbus': '<json selection>'}",
    )
    p.add_argument("--positions", default=None, help="default positions, e.g. last_prompt")
    p.add_argument("--actbus-config", default=None, help="extra actbus config as JSON")
    p.add_argument(
        "--actbus-admin-key",
        default=None,
        help="the key the steering endpoints (/v1/actbus/...) ask for, instead of --api-key: "
        f"completion callers cannot change global steering or vectors (also ${ADMIN_KEY_ENV})",
    )
    args, vllm_args = p.parse_known_args(argv)
    cfg = _actbus_config(args.actbus_config) if args.actbus_config else {}
    layers = args.layers.strip()
    cfg["layers"] = "all" if layers == "all" else [_int(x, "--layers") for x in layers.split(",")]
    cfg["hooks"] = [h.strip() for h in args.hooks.split(",") if h.strip()]
    cfg["requests"] = args.requests
    if args.publish:
        cfg["publish"] = args.publish
    if args.positions:
        cfg["positions"] = args.positions
    # Fail here, before the engine starts (two ranks on one address, too).
    CaptureConfig.from_dict(cfg).check_data_parallel(of_args(vllm_args)[0])
    if any(a == "--additional-config" or a.startswith("--additional-config=") for a in vllm_args):
        raise ConfigError("--additional-config: actbus serve writes it; use --actbus-config")
    # actbus's endpoints (actbus.engine.routes: fetching returned rows, and with steering
    # on named vectors and global steering) and the HTTP calls that bound returned rows
    # until they are sent, through vLLM's own --middleware flag.
    routes = ["--middleware", "actbus.engine.routes.middleware"]
    if args.actbus_admin_key is not None:
        if "steer" not in cfg:
            raise ConfigError(
                "--actbus-admin-key: this server has no steering endpoints; add a 'steer' "
                "entry to --actbus-config"
            )
        if not args.actbus_admin_key:
            raise ConfigError("--actbus-admin-key: an empty key")
        if env is not None:
            env[ADMIN_KEY_ENV] = args.actbus_admin_key
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--additional-config",
        json.dumps({"actbus": cfg}),
        *routes,
        *vllm_args,
    ]


def _actbus_config(text: str) -> dict[str, Any]:
    """``--actbus-config``: a JSON object (the keys of ``actbus.config.CaptureConfig``)."""
    example = """--actbus-config '{"steer": {"layers": [1, 3]}}'"""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--actbus-config: not valid JSON ({e.msg} at column {e.colno}); give a JSON "
            f"object in single quotes, e.g. {example}"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"--actbus-config: expected a JSON object, got {type(cfg).__name__}; e.g. {example}"
        )
    return cfg


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a layer index") from None


def capture_of(cmd: list[str]) -> CaptureConfig:
    """The capture config a ``serve_command`` argv carries."""
    raw = json.loads(cmd[cmd.index("--additional-config") + 1])["actbus"]
    return CaptureConfig.from_dict(raw)


def _precheck(cmd: list[str], cfg: CaptureConfig) -> list[str]:
    """What the model's config.json and the sources' files already refuse (ConfigError),
    before vLLM starts; the warnings. The engine is told it was done
    (``PRECHECKED_ENV``), so it does not warn again."""
    from actbus.precheck import PRECHECKED_ENV, model_shape, precheck

    model = cmd[cmd.index("--model") + 1]
    shape = model_shape(model, _option_values(cmd, "--served-model-name"))
    if shape is None:
        return []
    warnings = precheck(cfg, shape)
    os.environ[PRECHECKED_ENV] = "1"  # the server's environment
    return warnings


def _option_values(argv: list[str], flag: str) -> list[str]:
    """The values given after ``flag`` (``--flag a b`` or ``--flag=a``)."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag:
            out.extend(itertools.takewhile(lambda v: not v.startswith("-"), argv[i + 1 :]))
    return out


def _own_group() -> None:
    """In the child, before vLLM starts: a process group of its own (a terminal's
    Ctrl-C reaches only the supervisor, which passes it on once) and, on Linux, a
    SIGTERM if the supervisor dies (no server outlives it)."""
    os.setpgrp()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def supervise(
    cmd: list[str],
    cfg: CaptureConfig,
    ranks: list[int] | None = None,
    *,
    release_s: float | None = None,
) -> int:
    """Run the server ``cmd`` until it exits, passing signals on; then END to the
    subscribers of its publishers (one per data-parallel rank in ``ranks``), once their
    addresses are free (``release_s``: how long a dying engine may hold one, default
    ``farewell.RELEASE_S``). The server's exit status."""
    from actbus.bus.farewell import RELEASE_S, announce_end_all, wait_released

    release_s = RELEASE_S if release_s is None else release_s
    child = subprocess.Popen(cmd, preexec_fn=_own_group)  # no threads yet: preexec_fn is safe
    log.info("started vLLM's server (pid %d)", child.pid)

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)
        # In a signal handler: a line of its own, not through logging's locks.
        with contextlib.suppress(OSError):
            name = signal.Signals(signum).name
            os.write(2, f"actbus serve: {name}: stopping the server\n".encode())

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    addresses = [cfg.publish_address(r) for r in (ranks or [0])]
    log.info("the server exited (%d); ending the stream at %s", rc, ", ".join(addresses))
    if still := wait_released(addresses, release_s):
        _kill_leftovers(child.pid, still, release_s)
    told = announce_end_all(
        addresses,
        release_s=release_s,
        reason="the server stopped",
        server_secret_key=cfg.server_secret_key,
        authorized_keys=cfg.authorized_keys,
        insecure_allow_any_interface=cfg.insecure_allow_any_interface,
    )
    print(
        f"\nactbus serve: the server exited ({rc}); told {told} subscriber(s) at "
        f"{connect_spec(cfg.publish, ranks or [0])} the stream ended",
        file=sys.stderr,
        flush=True,
    )
    return rc if rc >= 0 else 128 - rc


def _kill_leftovers(group: int, held: list[str], waited_s: float) -> None:
    """The server exited, yet a process still holds its publisher's address: one of
    the server's own (an engine that outlived it, in its process group), which nothing
    would stop now. Killed, so the address is freed and END can be sent."""
    log.warning(
        "%s still held %.0fs after the server exited: killing what is left of its "
        "processes (process group %d)",
        ", ".join(held),
        waited_s,
        group,
    )
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    """start vLLM's OpenAI server with capture (see serve -h)"""
    try:
        cmd = serve_command(argv, os.environ)  # the server inherits the admin key
        cfg = capture_of(cmd)
        size, ranks = of_args(cmd)
        warnings = _precheck(cmd, cfg)
    except (ConfigError, json.JSONDecodeError) as e:
        print(f"actbus serve: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"actbus serve: warning: {w}", file=sys.stderr)
    show_own_logs("%(asctime)s actbus serve: %(message)s")
    layers = "all layers" if cfg.all_layers else f"layers {list(cfg.layers)}"
    where = connect_spec(cfg.publish, ranks)
    engines = "the engine" if size == 1 else f"data-parallel ranks {ranks} of {size}"
    print(
        f"actbus serve: {engines} will capture {layers}, hooks {list(cfg.hooks)} "
        f"({cfg.requests} requests) and publish on {where}; subscribe with "
        f"actbus run NAME --connect '{where}'",
        file=sys.stderr,
        flush=True,
    )
    return supervise(cmd, cfg, ranks)
