"""The closed loop: a probe trains live on served traffic, is pushed into the engine's
monitor as it trains, scores every token of later requests, and gates steering.

    python examples/closed_loop.py                      # the tiny Llama, on CPU
    python examples/closed_loop.py --connect ADDR --url http://HOST:PORT --control CTRL

1. `actbus serve` starts with a monitor `probe` (a sigmoid direction at the first
   layer, zero until trained), a control endpoint for pushes and steering at the next
   layer;
2. `actbus run probe --push CTRL` subscribes, and tagged requests (`label` 1: lists of
   numbers, 0: lists of words) go to the server over HTTP; the trainer pushes its
   weights into the monitor every few steps, and the scores returned with each response
   carry the version that made them;
3. held-out, untagged requests come back with their scores (`choices[i].actbus`): the
   live monitor's accuracy on them, beside the trainer's own held-out accuracy;
4. the probe's direction is registered as a steering vector, gated by the monitor:
   number and word prompts, unsteered then steered, change only where the monitor
   flags them.

What it saw lands in --out (default out/closed-loop): `closed_loop.json`, the probe's
checkpoint under `probes/`, the logs. A running server (--connect) must list a
directory holding --out in its `steer.vector_dirs`, to take the probe's path.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import common

WORDS = ["apples", "oranges", "pears", "questions", "answers", "lists", "code", "model"]
THRESHOLD = 0.5  # the monitor flags a token whose probability of label 1 is above it


def labelled(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` prompts with their label: 1 for a list of numbers, 0 for a list of words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        k = rng.randrange(10, 24)
        if label:
            text = " ".join(str(rng.randrange(100)) for _ in range(k))
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append((text, label))
    return out


def post(url: str, path: str, body: dict[str, Any], method: str = "POST") -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    req.method = method
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def completions(
    url: str, model: str, prompt: str | list[str], actbus: dict, **kw: Any
) -> list[dict[str, Any]]:
    """One ``/v1/completions`` call (a prompt or a batch of them); its choices, in order."""
    body = {"model": model, "prompt": prompt, "temperature": 0.0, **kw}
    body["vllm_xargs"] = {"actbus": json.dumps(actbus)}
    return sorted(post(url, "/v1/completions", body)["choices"], key=lambda c: c["index"])


def probe_scores(choice: dict[str, Any], layer: int) -> tuple[list[int], list[float], list[int]]:
    """The monitor's scores in a choice: (tokens fed, P(label 1) of each, versions)."""
    m = choice["actbus"]["monitor"]
    (series,) = [s for s in m["scores"]["probe"] if s["layer"] == layer]
    return m["token_ids"], [v[0] for v in series["values"]], series["version"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(common.ROOT / "out" / "closed-loop"))
    p.add_argument("--rounds", type=int, default=24, help="rounds of 16 tagged requests")
    p.add_argument("--heldout", type=int, default=48, help="untagged requests scored")
    p.add_argument("--connect", default=None, help="a running server's bus address")
    p.add_argument("--url", default=None, help="a running server's URL (with --connect)")
    p.add_argument("--control", default=None, help="its actbus.control address (with --connect)")
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    common.add_model_args(p)
    args = p.parse_args()
    if len({args.connect is None, args.url is None, args.control is None}) != 1:
        p.error("--connect, --url and --control go together (a running server)")
    model = common.model_of(args)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # a run starts clean
    out.mkdir(parents=True)
    layer, steer_layer = model.layers[0], model.layers[0] + 1

    server = None
    if args.connect is None:
        run = tempfile.mkdtemp(prefix="actbus-loop-")
        address, control = f"ipc://{run}/bus.sock", f"ipc://{run}/control.sock"
        url = f"http://127.0.0.1:{args.port or common.free_port()}"
        common.step(1, 4, f"actbus serve {model.path}: monitor 'probe' at layer {layer}")
        config = engine_config(model.path, layer, steer_layer, control, out / "probes")
        server = common.actbus(
            "serve", model.path, "--layers", str(layer), "--publish", address,
            "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], *model.serve_flags(),
            "--actbus-config", json.dumps(config),
            log=out / "server.log",
        )  # fmt: skip
        common.wait_http(f"{url}/health", 900, server)  # about a minute on CPU
    else:
        address, url, control = args.connect, args.url, args.control
        common.step(1, 4, f"a running server: {url}, bus {address}, control {control}")
    served = common.get_json(f"{url}/v1/models")["data"][0]["id"]
    result: dict[str, Any] = {"layer": layer, "steer_layer": steer_layer}
    try:
        ok = run_loop(args, model, out, address, url, control, served, result)
    finally:
        (out / "closed_loop.json").write_text(json.dumps(result))
        if server is not None:
            ok = common.finish(server, 120, signal.SIGINT) == 0 and ok
    return 0 if ok else 1


def engine_config(
    model_path: str, layer: int, steer_layer: int, control: str, probes: Path
) -> dict:
    """The server's actbus entry: the monitor the probe is pushed into, the control
    endpoint pushes arrive at, the points steering may use, and the directory the
    probe's checkpoint may be registered from over HTTP (``vector_dirs``)."""
    hidden = json.loads((Path(model_path) / "config.json").read_text())["hidden_size"]
    return {
        "monitor": {
            "monitors": {
                "probe": {"weight": [0.0] * hidden, "sigmoid": True, "layers": [layer]},
            }
        },
        "control": control,
        "steer": {
            "layers": [steer_layer],
            "hooks": ["post_block"],
            "vector_dirs": [str(probes.resolve())],
        },
    }


def run_loop(
    args: argparse.Namespace,
    model: common.Model,
    out: Path,
    address: str,
    url: str,
    control: str,
    served: str,
    result: dict[str, Any],
) -> bool:
    """Steps 2 to 4 against the server; what they saw goes into ``result``."""
    layer, steer_layer = result["layer"], result["steer_layer"]
    common.step(2, 4, f"actbus run probe --push {control}; tagged requests over HTTP")
    probe = common.actbus(
        "run", "probe", "--connect", address, "--layer", str(layer), "--label", "label",
        "--heldout", "0.3", "--batch-tokens", "128", "--buffer-tokens", "2048",
        "--warmup-tokens", "256", "--idle-s", "5", "--log-every", "2",
        "--push", control, "--push-every", "3", "--push-monitor", "probe",
        "--out", str(out / "probes"), "--summary", str(out / "probe.json"), "--no-progress",
        *model.trainer_flags(), log=out / "probe.log", env={"WANDB_MODE": "offline"},
    )  # fmt: skip
    common.wait_subscribed(address, {"probe"}, 300)
    versions: list[int] = []  # the newest version that scored each round's requests
    with ThreadPoolExecutor(4) as pool:
        for r in range(args.rounds):
            batch = labelled(16, seed=r)
            choices = pool.map(
                lambda it: completions(
                    url, served, it[0], max_tokens=1,
                    actbus={"tags": {"label": it[1]}, "monitor": ["probe"],
                            "monitor_return": True},
                )[0],
                batch,
            )  # fmt: skip
            versions.append(max(max(probe_scores(c, layer)[2]) for c in choices))
    rc = common.finish(probe, 300)  # it trains on what it holds, saves and exits (--idle-s)
    summary = json.loads((out / "probe.json").read_text())
    (saved,) = [d for d in (out / "probes").iterdir() if (d / "probe.json").exists()]
    own = next(v for k, v in summary["metrics"].items() if k.endswith("heldout_accuracy"))
    result.update(probe=str(saved), push=summary["push"], round_versions=versions)
    result["trainer_heldout_accuracy"] = own
    print(f"      {summary['steps']} steps; pushed versions {summary['push']['versions']}")
    print(f"      the newest version scoring each round: {versions}")

    common.step(3, 4, f"{args.heldout} held-out requests, untagged, scored by the live monitor")
    held = labelled(args.heldout, seed=10_000)
    choices = completions(
        url, served, [t for t, _ in held], max_tokens=1,
        actbus={"monitor": ["probe"], "monitor_return": True},
    )  # fmt: skip
    rows = []
    for (_, label), c in zip(held, choices, strict=True):
        ids, scores, vers = probe_scores(c, layer)
        rows.append({"label": label, "token_ids": ids, "scores": scores, "versions": vers})
    right = [int(s > THRESHOLD) == r["label"] for r in rows for s in r["scores"]]
    live = sum(right) / len(right)
    result.update(heldout=rows, live_accuracy=live)
    print(f"      live monitor: {live:.3f} of {len(right)} tokens right; trainer's own: {own:.3f}")

    common.step(4, 4, "the probe's direction, gated by the monitor, steers mixed prompts")
    post(url, "/v1/actbus/vectors/probe", {"probe": str(saved)}, method="PUT")
    mixed = [t for t, _ in labelled(12, seed=20_000)]
    ask = {"monitor": ["probe"], "monitor_return": True}
    plain = mixed_run(url, served, mixed, ask, layer)
    # The gate opens on a token that scores above the threshold, so a request is
    # flagged when its highest score is: a threshold between the two middle requests'
    # highest scores flags half of the batch.
    tops = sorted(max(r["scores"]) for r in plain)
    threshold = (tops[len(tops) // 2 - 1] + tops[len(tops) // 2]) / 2
    gated = {
        "vector": "probe", "layers": [steer_layer], "scale": 1.0, "norm_match": True,
        "gate": {"monitor": "probe", "threshold": threshold},
    }  # fmt: skip
    steered = mixed_run(url, served, mixed, {**ask, "steer": [gated]}, layer)
    batch = []
    print(f"      gate threshold {threshold:.3f}")
    for text, a, b in zip(mixed, plain, steered, strict=True):
        flagged, changed = max(a["scores"]) > threshold, a != b
        batch.append({"flagged": flagged, "plain": a, "steered": b})
        print(f"      {'flagged' if flagged else '       '} {'changed' if changed else '-':7} "
              f"{text[:28]!r:32} -> {a['text'][:20]!r} / {b['text'][:20]!r}")  # fmt: skip
    result.update(threshold=threshold, mixed=batch)
    same = all((b["plain"] != b["steered"]) == b["flagged"] for b in batch)
    print(f"      outputs changed exactly for the flagged requests: {same}")
    return rc == 0 and summary["push"]["errors"] == [] and same


def mixed_run(url: str, model: str, prompts: list[str], actbus: dict, layer: int) -> list[dict]:
    """The prompts one request at a time, greedy, 8 tokens each: each choice's text, the
    log probability of each of its tokens and the monitor's scores.

    One at a time, so the unsteered and the steered run compute each request in the same
    steps: a batch sent in one call reaches the engine request by request, and how many
    rows a step holds then depends on timing; the monitor's dot product, like any matrix
    product, may round its last bit differently with the rows beside it, and an
    unflagged request would then differ from its unsteered self in a score's last bit.
    """
    kw = {"max_tokens": 8, "logprobs": 1, "ignore_eos": True, "actbus": actbus}
    got = [completions(url, model, p, **kw)[0] for p in prompts]
    return [
        {
            "text": c["text"],
            "logprobs": c["logprobs"]["token_logprobs"],
            "scores": probe_scores(c, layer)[1],
            "versions": probe_scores(c, layer)[2],
        }
        for c in got
    ]


if __name__ == "__main__":
    sys.exit(main())
