"""``actbus serve``: vLLM's OpenAI-compatible server with the publisher on.

It only turns capture flags into vLLM's ``--additional-config`` and starts the
server as vLLM itself would; every other argument goes to vLLM unchanged, and the
config is validated the same way as in ``LLM(...)`` before the engine starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from actbus.config import REQUESTS, CaptureConfig
from actbus.errors import ConfigError
from actbus.flags import HelpFormatter
from actbus.streams import HOOKS


def serve_command(argv: list[str]) -> list[str]:
    """The vLLM server argv for ``actbus serve`` arguments (raises ConfigError)."""
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
    args, vllm_args = p.parse_known_args(argv)
    cfg: dict = json.loads(args.actbus_config) if args.actbus_config else {}
    layers = args.layers.strip()
    cfg["layers"] = "all" if layers == "all" else [_int(x, "--layers") for x in layers.split(",")]
    cfg["hooks"] = [h.strip() for h in args.hooks.split(",") if h.strip()]
    cfg["requests"] = args.requests
    if args.publish:
        cfg["publish"] = args.publish
    if args.positions:
        cfg["positions"] = args.positions
    CaptureConfig.from_dict(cfg)  # fail here, before the engine starts
    if any(a == "--additional-config" or a.startswith("--additional-config=") for a in vllm_args):
        raise ConfigError("--additional-config: actbus serve writes it; use --actbus-config")
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--additional-config",
        json.dumps({"actbus": cfg}),
        *vllm_args,
    ]


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a layer index") from None


def main(argv: list[str]) -> int:
    """start vLLM's OpenAI server with capture (see serve -h)"""
    try:
        cmd = serve_command(argv)
    except (ConfigError, json.JSONDecodeError) as e:
        print(f"actbus serve: {e}", file=sys.stderr)
        return 2
    os.execv(cmd[0], cmd)
    return 0  # not reached
