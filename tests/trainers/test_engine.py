"""End to end on the real engine: the tiny Llama served by vLLM with actbus, requests
tagged with a label, and an SAE and a probe training live from the bus (each its own
``actbus run`` process, default ``drop_oldest`` policy) while requests flow.

The SAE's FVU must fall, both offline W&B runs must hold the metrics (read back
from their ``.wandb`` files), and every drop is accounted for.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actbus.bus import Event, Subscriber, Subscription
from tests.support.procs import stop, wait_for
from trainers.wandb_log import read_history, run_files

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]


def _trainer(kind: str, address: str, out: Path, *flags: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "wb")  # noqa: SIM115 (lives with the process)
    cmd = [sys.executable, "-m", "actbus.cli", "run", kind, "--connect", address]
    cmd += ["--out", str(out), "--summary", str(out / "summary.json"), "--no-progress", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _subscribers(address: str) -> dict:
    with Subscriber(address, Subscription(layers=(), name="test-stats")) as sub:
        sub.wait_welcome(30)
        sub.request_stats()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = sub.recv(timeout=1)
            if isinstance(out, Event) and out.kind == "stats":
                return out.body["subscribers"]
    return {}


def _prompts(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = ["apples", "oranges", "pears", "questions", "answers", "lists", "code", "model"]
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        if label:
            text = " ".join(str(rng.randrange(100)) for _ in range(rng.randrange(12, 30)))
        else:
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(12, 30)))
        out.append((text, label))
    return out


def test_sae_and_probe_train_live_from_the_engine(sched_engine, tmp_path):
    from vllm import SamplingParams

    llm, address = sched_engine.llm, sched_engine.address
    data = ["--batch-tokens", "128", "--buffer-tokens", "4096", "--warmup-tokens", "512"]
    data += ["--idle-s", "6", "--log-every", "2", "--layer", "3"]
    sae_out, probe_out = tmp_path / "sae", tmp_path / "probe"
    sae = _trainer(
        "sae",
        address,
        sae_out,
        *data,
        "--kind",
        "topk",
        "--k",
        "8",
        "--expansion",
        "4",
        "--lr",
        "1e-3",
        "--checkpoint-every",
        "50",
    )
    probe = _trainer("probe", address, probe_out, *data, "--label", "label", "--heldout", "0.3")
    try:
        wait_for(
            lambda: {"sae", "probe"} <= set(_subscribers(address)),
            timeout=90,
            what="both trainers subscribed",
            interval=1.0,
        )
        t0 = time.monotonic()
        rounds = 0
        # 45 s of traffic, and at least 15 rounds however slow the machine (at most
        # 150 s): on a loaded machine 45 s gave too few steps for the loss to fall.
        while (time.monotonic() - t0 < 45 or rounds < 15) and time.monotonic() - t0 < 150:
            batch = _prompts(16, seed=rounds)
            params = [
                SamplingParams(
                    max_tokens=24,
                    extra_args={"actbus": {"tags": {"label": label}}},
                )
                for _, label in batch
            ]
            llm.generate([p for p, _ in batch], params, use_tqdm=False)
            rounds += 1
        # Requests stopped: the trainers drain their buffers, save and exit (--idle-s).
        assert sae.wait(timeout=120) == 0, (sae_out / "log.txt").read_text()[-3000:]
        assert probe.wait(timeout=120) == 0, (probe_out / "log.txt").read_text()[-3000:]
    finally:
        stop(sae)
        stop(probe)

    s = json.loads((sae_out / "summary.json").read_text())
    fvu = next(iter(s["fvu_history"].values()))
    print(
        f"\n{rounds} rounds; sae {s['steps']} steps, fvu {fvu[:3]} -> {fvu[-3:]}; data {s['data']}"
    )
    assert s["steps"] >= 20
    first, last = sum(fvu[:5]) / 5, sum(fvu[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    # Nothing unaccounted for: tokens trained + still buffered == rows received.
    d = s["data"]
    assert d["tokens/L3/post_block"] + d["overflow/L3/post_block"] == d["rows_in"]
    assert d["bus/received"] > 0

    p = json.loads((probe_out / "summary.json").read_text())
    print(f"probe {p['steps']} steps, metrics {p['metrics']}")
    assert p["steps"] >= 5

    # Checkpoint in SAELens layout, and both offline W&B runs hold their metrics.
    (ckpt,) = [d for d in sae_out.iterdir() if (d / "cfg.json").exists()]
    assert (ckpt / "sae_weights.safetensors").exists()
    for out, key in ((sae_out, f"{ckpt.name}/fvu"), (probe_out, "probe-logistic/loss")):
        (f,) = run_files(out)
        keys = set().union(*read_history(f))
        assert any(k.endswith(key) for k in keys), sorted(keys)
        assert any(k.startswith("data/") for k in keys)
        if out is probe_out:
            assert any(k.endswith("label/heldout_accuracy") for k in keys), sorted(keys)
