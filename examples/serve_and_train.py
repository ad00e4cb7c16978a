"""Journey 1: serve a model, and train an SAE and a probe on its residual stream live.

    python examples/serve_and_train.py                      # the tiny Llama, on CPU
    python examples/serve_and_train.py --gpu --model PATH --layers 8,16
    python examples/serve_and_train.py --connect ADDR --url http://HOST:PORT  # a running server
    ... --connect ADDR --url URL --until-end   # you stop that server; its END ends the journey

1. `actbus serve` starts vLLM's OpenAI server with capture on two layers;
2. `actbus run sae` (last layer) and `actbus run probe` (first layer, on the request tag
   `label`) subscribe, with `actbus run wandb` (offline without W&B credentials) and the
   web dashboard (`actbus dashboard`);
3. tagged requests go to the server over HTTP, as any client would send them;
4. the dashboard's snapshot is saved; Ctrl-C (SIGINT) stops the server, `actbus serve`
   sends END, and the trainers train on what they hold, save their checkpoints and exit
   (against a running server, the trainers get the Ctrl-C instead, or, with
   --until-end, the journey waits for you to stop the server);
5. it prints what was made: checkpoints, the probe's metrics, the W&B runs.

Everything lands under --out (default out/journey-serve).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import common


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(common.ROOT / "out" / "journey-serve"))
    p.add_argument("--requests", type=int, default=64, help="tagged requests to send")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per request")
    p.add_argument("--connect", default=None, help="a running server's bus address")
    p.add_argument("--url", default=None, help="a running server's URL (with --connect)")
    p.add_argument(
        "--until-end",
        action="store_true",
        help="with --connect: wait for the running server to be stopped (its END), instead "
        "of stopping the trainers",
    )
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    p.add_argument("--dashboard-port", type=int, default=0, help="default: a free one")
    common.add_model_args(p)
    args = p.parse_args()
    if (args.connect is None) != (args.url is None):
        p.error("--connect and --url go together (a running server)")
    if args.until_end and args.connect is None:
        p.error("--until-end is for a running server (--connect, --url)")
    model = common.model_of(args)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # a journey starts clean
    out.mkdir(parents=True)
    first, last = model.layers[0], model.layers[-1]

    server = None
    if args.connect is None:
        address = f"ipc://{tempfile.mkdtemp(prefix='actbus-journey-')}/bus.sock"
        url = f"http://127.0.0.1:{args.port or common.free_port()}"
        common.step(1, 5, f"actbus serve {model.path} --layers {first},{last} on {address}")
        server = common.actbus(
            "serve", model.path, "--layers", ",".join(map(str, model.layers)),
            "--publish", address, "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
            *model.serve_flags(), log=out / "server.log",
        )  # fmt: skip
        common.wait_http(f"{url}/health", 900, server)  # about a minute on CPU
    else:
        address, url = args.connect, args.url
        common.step(1, 5, f"a running server: {url}, bus {address}")
    served = common.get_json(f"{url}/v1/models")["data"][0]["id"]

    common.step(2, 5, "trainers, W&B and the web dashboard subscribe")
    wandb_env = {"WANDB_PROJECT": "actbus-journey", "WANDB_RUN_GROUP": "serve-and-train"}
    if not common.has_wandb_credentials():
        wandb_env["WANDB_MODE"] = "offline"
    trainer_flags = ["--no-progress", *model.trainer_flags()]
    sae = common.actbus(
        "run", "sae", "--connect", address, "--layer", str(last), "--k", "8",
        "--expansion", "4", "--out", str(out / "saes"), "--summary", str(out / "sae.json"),
        *trainer_flags, log=out / "sae.log", env=wandb_env,
    )  # fmt: skip
    probe = common.actbus(
        "run", "probe", "--connect", address, "--layer", str(first), "--label", "label",
        "--out", str(out / "probes"), "--summary", str(out / "probe.json"), *trainer_flags,
        log=out / "probe.log", env=wandb_env,
    )  # fmt: skip
    wandb = common.actbus(
        "run", "wandb", "--connect", address, "--exit-on-end", "--interval", "2",
        "--wandb-dir", str(out), log=out / "wandb.log", env=wandb_env,
    )  # fmt: skip
    board_url = f"http://127.0.0.1:{args.dashboard_port or common.free_port()}"
    board = common.actbus(
        "dashboard", "--connect", address, "--port", board_url.rsplit(":", 1)[1],
        log=out / "dashboard.log",
    )  # fmt: skip
    common.wait_subscribed(address, {"sae", "probe", "wandb", "dashboard"}, 300)
    print(f"      the web dashboard: {board_url}")

    common.step(3, 5, f"{args.requests} requests, each tagged with a label, over HTTP")
    t0 = time.monotonic()
    tokens = common.send_all(url, served, common.prompts(args.requests), args.max_tokens)
    print(f"      {tokens} tokens fed to the model in {time.monotonic() - t0:.0f}s")

    common.step(4, 5, "the dashboard's snapshot; then Ctrl-C")
    time.sleep(3.0)  # a refresh or two after the last step
    snapshot = common.get_json(f"{board_url}/api/snapshot")
    (out / "dashboard.json").write_text(json.dumps(snapshot))
    ends = server is not None or args.until_end  # the stream ends for every subscriber: END
    if server is not None:
        server_rc = common.finish(server, 120, signal.SIGINT)
    else:
        server_rc = 0
        if args.until_end:
            print("      waiting for the server to stop (Ctrl-C in its terminal)", flush=True)
    # A server that goes on: the trainers are the ones stopped.
    trainer_rcs = [common.finish(t, 300, None if ends else signal.SIGINT) for t in (sae, probe)]
    wandb_rc = common.finish(wandb, 120, None if ends else signal.SIGINT)
    common.finish(board, 30, signal.SIGINT)

    common.step(5, 5, f"what was made, under {out}")
    ok = server_rc == 0 and wandb_rc == 0 and trainer_rcs == [0, 0]
    for name in ("sae", "probe"):
        summary = out / f"{name}.json"
        if not summary.exists():
            print(f"      {name}: no summary; see {out / (name + '.log')}")
            ok = False
            continue
        s = json.loads(summary.read_text())
        saved = sorted(str(d) for d in (out / f"{name}s").glob("*/") if d.name != "wandb")
        print(f"      {name}: {s['steps']} steps on {int(s['data'].get('rows_in', 0))} tokens")
        if s.get("dropped"):  # drop_oldest: generation never waited for training
            print(
                f"        the publisher dropped {s['dropped']} of {s['routed']} messages for it "
                f"(--policy {s['policy']}; --policy block trains on all, generation waits)"
            )
        for d in saved:
            print(f"        saved {d}")
        shown = {k.split("/", 1)[1]: round(v, 3) for k, v in s["metrics"].items()}
        print(f"        last metrics {shown}")
        ok = ok and s["steps"] > 0 and bool(saved)
    runs = sorted(out.rglob("*run-*/run-*.wandb"))
    offline = "WANDB_MODE" in wandb_env
    mode = "offline: upload with wandb sync" if offline else "online"
    print(f"      W&B runs: {len(runs)} ({mode})")
    for r in runs:
        print(f"        {'wandb sync ' if offline else ''}{r.parent}")
    bus = snapshot.get("bus") or {}
    print(f"      dashboard: {bus.get('tokens', 0)} tokens counted, {bus.get('subscribers')} subs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
