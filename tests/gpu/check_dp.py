"""GPU check (run through the device machine, not in CI): data parallelism end to end.

``actbus serve --data-parallel-size 2`` serves a tiny Llama on two GPUs (vLLM's
defaults: torch.compile, CUDA graphs), each rank publishing on its own address of one
``{dp_rank}`` template. Beside it, as a user would start them:
- an in-process subscriber over both ranks (``--connect`` range) keeps every row;
- ``actbus run sae --connect ipc:///...{0..1}`` trains on both ranks' tokens, with a
  ledger of every (request, position) it trained (run as ``bench_journey.py`` runs it,
  so that it needs no wandb where the GPU machine has none).
Completions go over HTTP, concurrently, so vLLM spreads them over both ranks. Then the
server is stopped (SIGINT, as Ctrl-C): END reaches the trainer, which trains on what it
holds, saves and exits. Checked:
- both ranks served requests, and each request's rows came from exactly one rank;
- per rank, every position of every request once, equal to HF transformers' forward on
  the same GPU and dtype (the capture oracle's bf16 bound, 2e-2 of the row's norm);
- the trainer trained every token of its layer exactly once, from both publishers.
Prints one JSON line.
    python tests/gpu/check_dp.py --dtype bfloat16      # needs 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LAYERS = [0, 3]
HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block"]
TRAIN_LAYER = 3


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True}
    ).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU")
    ap.add_argument("--tol", type=float, default=None)
    ap.add_argument("--start-timeout", type=float, default=600)
    args = ap.parse_args()
    from tests.support.installed import gpu_memory, require_actbus_plugin

    require_actbus_plugin()
    import torch

    from actbus.bus.endpoints import connect_spec
    from actbus.streams import point_key
    from actbus.tiny_models import build_tiny_model
    from tests.support.oracle import hf_activations, max_rel_error
    from tests.support.procs import free_port, wait_healthy
    from tests.support.recorder import RowRecorder

    path = build_tiny_model("llama", hidden_size=256, intermediate_size=512, initializer_range=0.02)
    work = Path(tempfile.mkdtemp(prefix="check-dp-"))
    template = f"ipc://{work}/actbus-{{dp_rank}}.sock"
    spec = connect_spec(template, [0, 1])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "server.log"
    cmd = [
        sys.executable, "-m", "actbus.cli", "serve", str(path),
        "--layers", ",".join(map(str, LAYERS)), "--hooks", ",".join(HOOKS),
        "--publish", template, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--max-model-len", "640",
        "--data-parallel-size", "2", "--served-model-name", "m",
    ]  # fmt: skip
    if args.device == "cpu":
        cmd += ["--enforce-eager", "--gpu-memory-utilization", "0.3"]
    else:  # its share of each GPU, as the other checks take (run_all: lanes share GPUs)
        for k, v in gpu_memory().items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.monotonic()
    with open(log, "w") as logf:
        server = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=work)
    trainer = None
    problems: list[str] = []
    try:
        wait_healthy(url, server, log, args.start_timeout)
        start_s = time.monotonic() - t0
        col = RowRecorder(spec)
        ledger = work / "ledger"
        with open(work / "trainer.log", "w") as tlog:
            trainer = subprocess.Popen(
                # ``actbus run sae`` as bench_journey runs it: the same trainer, without
                # its W&B logger where wandb is not installed (the GPU machine's bundle).
                [sys.executable, str(ROOT / "benchmarks" / "bench_journey.py"),
                 "--trainer-stats", str(work / "trainer-stats.json"), "--connect", spec,
                 "--layer", str(TRAIN_LAYER), "--k", "8", "--expansion", "4",
                 "--policy", "block", "--batch-tokens", "256", "--warmup-tokens", "256",
                 "--accelerator", "gpu" if args.device == "cuda" else "cpu",
                 "--out", str(work / "sae"), "--no-progress", "--ledger", str(ledger),
                 "--summary", str(work / "summary.json")],
                stdout=tlog, stderr=subprocess.STDOUT, env=env, cwd=work,
            )  # fmt: skip
        # The trainer must hold both ranks' subscriptions (its group's, "as sae") before
        # the first row.
        deadline = time.monotonic() + 300
        while len(set(re.findall(r"subscribed to the publisher at (\S+) .*as sae\)",
                                 (work / "trainer.log").read_text()))) < 2:  # fmt: skip
            if trainer.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, 500) for _ in range(rng.choice([5, 17, 60, 130, 300]))]
            for _ in range(args.requests)
        ]
        results: list[dict | None] = [None] * len(prompts)

        def send(i: int) -> None:
            try:
                results[i] = _complete(url, prompts[i], args.max_tokens)
            except Exception as e:  # said below
                problems.append(f"request {i}: {e!r}")

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        want_ends = len(prompts)
        col.wait(lambda c: len(c.ended) >= want_ends, 120, "every request's end")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            problems.append("actbus serve did not stop within 120 s of SIGINT")
    trainer_rc = None
    if trainer is not None:
        try:
            trainer_rc = trainer.wait(timeout=600)
        except subprocess.TimeoutExpired:
            trainer.kill()
            problems.append("the trainer did not exit within 600 s of the server's stop")
    col.close()

    torch.set_float32_matmul_precision("highest")
    dt = getattr(torch, args.dtype)
    worst: dict[str, float] = {}
    per_rank = Counter()
    served: set[tuple[str, str]] = set()
    for (rid, sidx), sources in sorted(col.sources.items()):
        ranks = {s.dp_rank for s in sources}
        if len(ranks) != 1:
            problems.append(f"{rid}: rows from ranks {sorted(ranks)}")
            continue
        (rank,) = ranks
        per_rank[rank] += 1
        pos, fed, _ = col.get(rid, LAYERS[0], HOOKS[0], sidx)
        fed = fed.tolist()
        if pos.tolist() != list(range(len(fed))):
            problems.append(f"{rid}: positions not 0..n-1 once ({len(pos)} rows)")
            continue
        if not any(fed[: len(p)] == p for p in prompts):
            problems.append(f"{rid}: its token ids start with no prompt sent")
        ref = hf_activations(path, fed, LAYERS, HOOKS, dtype=dt, device=args.device)
        for layer in LAYERS:
            for hook in HOOKS:
                p2, t2, acts = col.get(rid, layer, hook, sidx)
                if p2.tolist() != pos.tolist() or t2.tolist() != fed:
                    problems.append(f"{rid} L{layer} {hook}: positions differ between points")
                    continue
                err = max_rel_error(acts.float().to(args.device), ref[(layer, hook)].float())
                key = f"rank{rank}/{point_key(layer, hook)}"
                worst[key] = max(worst.get(key, 0.0), err)
        served.update((rid, str(p)) for p in pos.tolist())
    if len(col.sources) != len(prompts):
        problems.append(f"rows of {len(col.sources)} requests, {len(prompts)} sent")
    if not (per_rank[0] and per_rank[1]):
        problems.append(f"requests per rank {dict(per_rank)}: one rank served none")

    trained: list[tuple[str, str]] = []
    for f in sorted(work.glob("ledger.rank*")):
        for line in f.read_text().splitlines():
            _key, rid, p = line.split("\t")
            trained.append((rid, p))
    twice = [k for k, c in Counter(trained).items() if c > 1]
    if twice:
        problems.append(f"trained twice: {len(twice)} tokens, e.g. {twice[:3]}")
    if set(trained) != served:
        problems.append(
            f"trained {len(set(trained))} tokens, served {len(served)} at L{TRAIN_LAYER}: "
            f"missing {len(served - set(trained))}, extra {len(set(trained) - served)}"
        )
    summary = {}
    if (work / "summary.json").exists():
        summary = json.loads((work / "summary.json").read_text())
    from_pubs = {k: v for k, v in summary.get("data", {}).items() if k.endswith("/received")}
    if trainer_rc != 0:
        problems.append(f"trainer exit {trainer_rc}: {(work / 'trainer.log').read_text()[-1500:]}")
    tol = args.tol or (1e-3 if args.dtype == "float32" else 2e-2)
    ok = not problems and all(e <= tol for e in worst.values())
    print(
        json.dumps(
            {
                "check": "data_parallel_gpu",
                "ok": ok,
                "dtype": args.dtype,
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "engine_start_s": round(start_s, 1) if "start_s" in locals() else None,
                "requests": len(prompts),
                "requests_per_rank": dict(per_rank),
                "tokens_served": len(served),
                "tokens_trained": len(trained),
                "trainer_steps": summary.get("steps"),
                "trainer_received_per_publisher": from_pubs,
                "max_rel_err": worst,
                "tolerance": tol,
                "problems": problems[:10],
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
