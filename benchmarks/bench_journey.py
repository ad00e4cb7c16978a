"""The whole journey on one GPU: vLLM serving while an SAE trains live beside it (issue 17).

Llama-3-8B shape with dummy bf16 weights, PROMPTS prompts of INPUT random token ids,
OUTPUT new tokens each, offline ``LLM``. Each arm runs in its own process (a fresh
engine), with vLLM's defaults (torch.compile, CUDA graphs) and the same
``gpu_memory_utilization`` (room left for the trainer):

    plain   actbus not loaded (VLLM_PLUGINS names no plugin)
    block   layer 16 (post_block) captured and published; at the same time, on the same
            GPU: ``actbus run sae`` (topk, 16x, k=64, bf16-mixed, policy block),
            ``actbus run wandb`` (offline) and ``actbus run fs-sink`` storing a reduced
            copy (every 64th step, int8)
    drop    the same, the trainer's policy drop_oldest and ``--max-duty DROP_DUTY``
            (default 0.02): it rests after each step so that it spends at most that share
            of its time in steps, and what it cannot take is dropped and counted (without
            the cap an SAE that keeps up takes as much GPU time as under block). Two
            processes time-slice one GPU, so a trainer busy a share d of the time costs
            generation at least about d: the target of 0.95 leaves room for d = 0.02 and
            the sink, not for 0.05 (which ran at 0.834 with the sink and W&B)

Two diagnostic arms run only when named in ``--arms``: ``drop_sae`` (the drop arm's
trainer alone) and ``side`` (its fs sink and W&B consumer alone, no trainer).

The consumers start once the engine is up and its warm-up done, and the generation
starts once all of them subscribed; the engine's shutdown sends END, and the trainer
trains on what it holds, saves and exits. Reported per arm: generated tok/s and the
ratio to plain; tokens served (rows at the layer: prompt + generated - 1 per request);
tokens trained (the trainer's ``--summary``: ``data/tokens/L16.post_block``) and their
share of those served; drops (the trainer's ``bus/missed``, the publisher's count for
it); the trainer's tokens/s (tokens trained over the time from its first step to its
last); the GPU memory split (the engine's share and the trainer's peak from
``torch.cuda.max_memory_allocated``, plus nvidia-smi's peaks where it runs).

The trainer runs as ``actbus run sae`` does (``trainers.cli.sae_main``), in a process
of this script that adds one Lightning callback measuring its time and memory. Without
wandb installed the wandb consumer is skipped (said, and ``"wandb"`` in the JSON says
so) and the trainer runs without its W&B logger.

Prints a table, then one JSON line with every figure; targets: block >= 0.85 of plain
with trained share 1.0, drop >= 0.95 of plain.

    python benchmarks/bench_journey.py [--prompts 2048 --input 256 --output 256]
    python benchmarks/bench_journey.py --tiny      # CPU smoke test: the tiny Llama

The trainer takes ``--sae-batch-tokens`` rows a step (8192 on a GPU). ``--mps`` runs
every arm, plain included, under an MPS daemon of its own (``benchmarks/mps.py``), so
that the engine and the trainer share the GPU's SMs instead of time-slicing it.
``--trainer-gpu 1`` puts the trainer, the sink and W&B on the second visible GPU and
leaves the first to the engine (the journey on two GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from actbus.cli import quiet_openmp  # noqa: E402
from benchmarks.bench_capture import LLAMA3_8B  # noqa: E402  (one shape for both benchmarks)
from benchmarks.engine_arms import engine_cost, engine_counters  # noqa: E402
from benchmarks.mps import mps_daemon  # noqa: E402

ARMS = {"plain": None, "block": "block", "drop": "drop_oldest", "drop_sae": "drop_oldest",
        "side": "drop_oldest"}  # fmt: skip
"""Arm -> the trainer's policy (None: no capture at all)."""
CONSUMERS = {"drop_sae": ("sae",), "side": ("fs-sink", "wandb")}
"""Diagnostic arms, run only when asked: which consumers run (the others run all three).
``drop_sae`` is the drop arm with the trainer alone, ``side`` the drop arm without it:
together they split what the drop arm costs generation between the SAE and the rest."""
TARGETS = {"ratio_engine_block": 0.85, "trained_share_block": 1.0, "ratio_engine_drop": 0.95}
SINK_REDUCE = "int8"
"""The fs sink's reduced copy: every ``--sink-every``-th step (``sample:N``, lossy: it
never holds the engine back), stored as int8 with a per-row scale."""
DEFAULTS: dict[str, dict[str, Any]] = {
    # On an H100 (about 14k generated tok/s), 2048 x 256/256 generates for about 40 s.
    "gpu": {"prompts": 2048, "input": 256, "output": 256, "layer": 16, "sink_every": 64},
    "tiny": {"prompts": 16, "input": 32, "output": 32, "layer": 3, "sink_every": 4},
}
# Rows per SAE step. Per row, a step's fixed costs (Adam over 0.5 G parameters, the
# decoder's projection and renormalisation) halve from 4096 to 8192: 6.35 against 5.15 us
# a row on an H200 (benchmarks/RESULTS.md, "SAE training throughput").
DEFAULTS["gpu"]["sae_batch_tokens"] = 8192
DEFAULTS["tiny"]["sae_batch_tokens"] = 4096
DEFAULTS["gpu"]["gpu_memory_utilization"] = 0.6  # the rest is the trainer's
DEFAULTS["tiny"]["gpu_memory_utilization"] = 0.3  # on CPU: the KV cache's share of memory
TRAINER_STATS = "--trainer-stats"
"""First argument of this script's trainer mode: ``--trainer-stats FILE SAE_ARGS...``."""


def has_wandb() -> bool:
    """Whether ``import wandb`` works here (the GPU machine's bundle may lack it)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def sink_flags(args: argparse.Namespace) -> list[str]:
    return ["--policy", f"sample:{args.sink_every}", "--reduce", SINK_REDUCE]


# ------------------------------------------------------------------ trainer process
def trainer_main(stats_path: str, argv: list[str]) -> int:
    """``actbus run sae ARGV``, plus a callback writing its time and peak memory to
    ``stats_path``."""
    if not has_wandb():  # its W&B logger needs wandb; the benchmark does not
        import types

        stub = types.ModuleType("trainers.wandb_log")
        stub.make_logger = lambda *a, **k: False  # type: ignore[attr-defined]
        sys.modules["trainers.wandb_log"] = stub
        print("wandb is not installed: the trainer runs without its W&B logger", flush=True)
    import lightning.pytorch as pl
    import torch

    import trainers.sae_module as sae_module

    stats: dict[str, Any] = {"steps": 0}

    class Measure(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            stats.setdefault("first_step_at", time.time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            stats["steps"] += 1

        def on_train_end(self, trainer, pl_module) -> None:  # before the checkpoints
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                stats["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
                stats["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
            stats["last_step_at"] = time.time()

    class MeasuredSAETrainer(sae_module.SAETrainer):
        def configure_callbacks(self) -> list[pl.Callback]:
            return [Measure(), *super().configure_callbacks()]

    sae_module.SAETrainer = MeasuredSAETrainer  # type: ignore[misc]
    from trainers.cli import sae_main

    rc = sae_main(argv)
    stats["exited_at"] = time.time()
    Path(stats_path).write_text(json.dumps(stats))
    return rc


# ------------------------------------------------------------------- arm process
class GpuMemory(threading.Thread):
    """Peaks of nvidia-smi's used memory, for the device and per process, once a second."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.total_mib = 0.0
        self.peak_used_mib = 0.0
        self.per_pid: dict[int, float] = {}
        self.ok = shutil.which("nvidia-smi") is not None

    def _query(self, what: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    def run(self) -> None:
        while self.ok and not self.stop.wait(1.0):
            try:
                for used, total in self._query("gpu=memory.used,memory.total"):
                    self.peak_used_mib = max(self.peak_used_mib, float(used))
                    self.total_mib = float(total)
                for row in self._query("compute-apps=pid,used_memory"):
                    if len(row) == 2 and row[0].isdigit() and row[1].isdigit():  # not [N/A]
                        pid, used = int(row[0]), float(row[1])
                        self.per_pid[pid] = max(self.per_pid.get(pid, 0.0), used)
            except (OSError, ValueError, subprocess.SubprocessError):
                self.ok = False


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _model(args: argparse.Namespace, work: Path) -> tuple[Path, int]:
    """The model directory and its vocabulary size."""
    if args.tiny:
        from actbus.tiny_models import build_tiny_model

        path = build_tiny_model("llama")
        return path, int(json.loads((path / "config.json").read_text())["vocab_size"])
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(LLAMA3_8B))
    return work / "model", LLAMA3_8B["vocab_size"]


def _consumers(
    arm: str, policy: str, address: str, args: argparse.Namespace, work: Path
) -> dict[str, subprocess.Popen]:
    """The trainer, the W&B dashboard (where wandb is installed) and the fs sink."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "WANDB_PROJECT": "actbus-bench-journey",
        "WANDB_SILENT": "true",
    }
    quiet_openmp(env)  # the trainer runs from this script, not `actbus run sae`: the same env
    if args.trainer_gpu is not None:  # the consumers on a GPU of their own, the engine alone
        env["CUDA_VISIBLE_DEVICES"] = trainer_device(args.trainer_gpu)
    sae = [
        sys.executable, __file__, TRAINER_STATS, str(work / "trainer-stats.json"),
        "--connect", address, "--layer", str(args.layer), "--hook", "post_block",
        "--policy", policy, "--out", str(work / "saes"), "--summary", str(work / "sae.json"),
        "--no-progress", *sae_flags(args),
    ]  # fmt: skip
    if policy != "block" and args.drop_duty < 1.0:
        sae += ["--max-duty", str(args.drop_duty)]
    sink = [
        sys.executable, "-m", "actbus.cli", "run", "fs-sink", "--connect", address,
        "--out", str(work / "run"), "--layers", str(args.layer), "--hooks", "post_block",
        *sink_flags(args), "--exit-on-end",
    ]  # fmt: skip
    want = CONSUMERS.get(arm, ("sae", "fs-sink", "wandb"))
    procs = {}
    if "sae" in want:
        procs["sae"] = _spawn(sae, work / "sae.log", env)
    if "fs-sink" in want:
        procs["fs-sink"] = _spawn(sink, work / "fs-sink.log", env)
    if has_wandb() and "wandb" in want:
        wandb = [
            sys.executable, "-m", "actbus.cli", "run", "wandb", "--connect", address,
            "--exit-on-end", "--interval", "2", "--wandb-dir", str(work),
        ]  # fmt: skip
        procs["wandb"] = _spawn(wandb, work / "wandb.log", env)
    return procs


def trainer_device(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the consumers: the ``index``-th GPU this script
    sees (the engine takes the first)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(index)
    if index >= len(visible):
        raise SystemExit(f"--trainer-gpu {index}: only {len(visible)} GPUs are visible")
    return visible[index]


def sae_flags(args: argparse.Namespace) -> list[str]:
    """The journey's SAE: topk, 16x, k=64, ``--sae-batch-tokens`` rows a step, bf16-mixed
    on the GPU (32-true with ``--tiny``)."""
    device = ["--accelerator", "cpu", "--precision", "32-true"] if args.tiny else [
        "--accelerator", "gpu", "--precision", "bf16-mixed"]  # fmt: skip
    return ["--kind", "topk", "--expansion", "16", "--k", "64",
            "--batch-tokens", str(args.sae_batch_tokens), *device]  # fmt: skip


def engine(
    args: argparse.Namespace, model_dir: Path, vocab: int, extra: dict[str, Any]
) -> tuple[Any, list[Any], Any]:
    """The arm's engine (vLLM's defaults, the arm's ``additional_config``), warmed up
    before anyone subscribes, its prompts and the timed generation's sampling params."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        str(model_dir),
        load_format="auto" if args.tiny else "dummy",
        skip_tokenizer_init=True,
        dtype="float32" if args.tiny else "bfloat16",
        max_model_len=args.input + args.output + 8,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        additional_config=extra,
    )
    rng = random.Random(0)
    low = min(1000, vocab // 4)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(low, vocab) for _ in range(args.input)])
        for _ in range(args.prompts)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    llm.generate(
        prompts[:16],
        SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )  # warm-up: nothing of it is served
    return llm, prompts, sp


def run_arm(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One arm, in this process: the engine, its consumers, the timed generation."""
    import common  # examples/common.py: waiting for subscribers, stopping processes

    work = Path(args.work) / name
    work.mkdir(parents=True)
    model_dir, vocab = _model(args, work)
    policy = ARMS[name]
    address = f"ipc://{tempfile.mkdtemp(prefix='actbus-bench-')}/bus.sock"
    extra: dict[str, Any] = {}
    if policy is not None:
        extra = {"actbus": {"publish": address, "layers": [args.layer], "queue_mb": args.queue_mb}}

    t0 = time.monotonic()
    llm, prompts, sp = engine(args, model_dir, vocab, extra)
    start_s = time.monotonic() - t0

    procs: dict[str, subprocess.Popen] = {}
    result: dict[str, Any] = {"arm": name, "engine_start_s": round(start_s, 1)}
    if policy is not None:
        t0 = time.monotonic()
        procs = _consumers(name, policy, address, args, work)
        try:
            common.wait_subscribed(address, set(procs), args.subscribe_timeout)
        except SystemExit as e:
            for p in procs.values():
                common.finish(p, 10, signal.SIGTERM)
            logs = {n: (work / f"{n}.log").read_text()[-3000:] for n in procs}
            raise SystemExit(f"{name}: {e}\n{json.dumps(logs, indent=1)}") from None
        result["subscribe_s"] = round(time.monotonic() - t0, 1)

    mem = GpuMemory()
    mem.start()
    before = engine_counters(address) if policy is not None else None
    cpu0 = {n: _cpu_s(p.pid) for n, p in procs.items()}
    t0 = time.monotonic()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.monotonic() - t0
    gen_end = time.time()
    if before is not None:  # where the cost lies: the engine's thread, the consumers' CPU
        result["cost"] = engine_cost(before, engine_counters(address))
        result["cost"]["consumer_cpu_s"] = {
            n: round(_cpu_s(p.pid) - cpu0[n], 2) for n, p in procs.items()
        }
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    served = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    result |= {
        "gen_s": round(gen_s, 2),
        "generated_tokens": generated,
        "tok_per_s": round(generated / gen_s, 1),
        "served_rows": served,
    }
    if policy is not None:
        result["publisher"] = _publisher_stats(address)
    llm.llm_engine.engine_core.shutdown()  # the publisher sends END
    rcs = {n: common.finish(p, args.consumer_timeout) for n, p in procs.items()}
    mem.stop.set()
    mem.join(timeout=15)
    if mem.total_mib:
        result["gpu_total_mib"] = mem.total_mib
        result["gpu_used_peak_mib"] = mem.peak_used_mib
    if policy is not None:
        result |= _collect(work, procs, rcs, mem, gen_end)
    return result


def _cpu_s(pid: int) -> float:
    """A process' CPU seconds so far (user and system, its waited-for children's too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _publisher_stats(address: str) -> dict[str, Any]:
    """The publisher's own counters right after the generation (stall time, drops)."""
    from actbus.bus import Subscriber, Subscription
    from actbus.bus.statsview import request

    with Subscriber(address, Subscription(layers=(), name="bench-stats")) as sub:
        sub.wait_welcome(30)
        s = request(sub, 10)
    return {
        "stall_s": s.get("stall_s", 0.0),
        "source_drops": s.get("source_drops", 0),
        "subscribers": {
            n: {k: v.get(k) for k in ("policy", "routed", "sent", "dropped")}
            for n, v in (s.get("subscribers") or {}).items()
            if n != "bench-stats"
        },
    }


def _collect(
    work: Path,
    procs: dict[str, subprocess.Popen],
    rcs: dict[str, int],
    mem: GpuMemory,
    gen_end: float,
) -> dict[str, Any]:
    """What the consumers report once they exited: the trainer's summary and stats, the
    sink's manifest, the W&B runs."""
    out: dict[str, Any] = {"exit_codes": rcs}
    failed = {n: rc for n, rc in rcs.items() if rc != 0}
    if failed:
        logs = {n: (work / f"{n}.log").read_text()[-4000:] for n in failed}
        raise SystemExit(f"consumers failed {failed}:\n{json.dumps(logs, indent=1)}")
    if "fs-sink" in procs:
        manifest = json.loads((work / "run" / "manifest.json").read_text())
        out["sink"] = {
            "rows_written": manifest.get("total_rows", 0),
            "shards": len(manifest.get("shards", [])),
            "bytes": sum(s.get("bytes", 0) for s in manifest.get("shards", [])),
            "rows_received": manifest.get("counters", {}).get("rows_received", 0),
        }
    if "wandb" in procs:
        runs = sorted(work.glob("wandb/*run-*/run-*.wandb"))
        out["wandb"] = {"runs": len(runs), "bytes": sum(r.stat().st_size for r in runs)}
    if "sae" not in procs:
        return out
    summary = json.loads((work / "sae.json").read_text())
    stats = json.loads((work / "trainer-stats.json").read_text())
    data = summary["data"]
    trained = int(sum(v for k, v in data.items() if k.startswith("tokens/")))
    train_s = stats.get("last_step_at", 0.0) - stats.get("first_step_at", 0.0)
    out["trainer"] = {
        "steps": summary["steps"],
        "duty": summary.get("duty"),
        "rows_received": int(data.get("rows_in", 0)),
        "tokens_trained": trained,
        "missed": int(data.get("bus/missed", 0)),
        "publisher_dropped": int(data.get("bus/publisher_dropped", 0)),
        "overflow": int(sum(v for k, v in data.items() if k.startswith("overflow/"))),
        "train_s": round(train_s, 2),
        "tok_per_s": round(trained / train_s, 1) if train_s > 0 else None,
        "after_generation_s": round(stats["exited_at"] - gen_end, 1),
        "peak_allocated_mib": round(stats.get("peak_allocated_mib", 0.0), 1),
        "peak_reserved_mib": round(stats.get("peak_reserved_mib", 0.0), 1),
        "smi_peak_mib": mem.per_pid.get(procs["sae"].pid),
        "fvu": next((v for k, v in summary["metrics"].items() if k.endswith("/fvu")), None),
        "saved": sorted(p.name for p in (work / "saes").iterdir() if p.is_dir()),
    }
    if mem.per_pid:
        others = {pid: m for pid, m in mem.per_pid.items() if pid != procs["sae"].pid}
        out["smi_peak_mib_other_processes"] = others
    return out


# -------------------------------------------------------------------------- main
def _row(name: str, r: dict[str, Any], base: float | None) -> str:
    ratio = r["tok_per_s"] / base if base else float("nan")
    t = r.get("trainer")
    if t is None:
        return f"{name:8s} {r['tok_per_s']:>10.1f} {ratio:>7.3f} {r['served_rows']:>11,}"
    share = t["tokens_trained"] / r["served_rows"]
    mem = t["peak_allocated_mib"] / 1024
    tps = t["tok_per_s"] or 0.0
    return (
        f"{name:8s} {r['tok_per_s']:>10.1f} {ratio:>7.3f} {r['served_rows']:>11,} "
        f"{t['tokens_trained']:>11,} {share:>7.3f} {t['missed']:>7,} {tps:>11.1f} {mem:>9.2f} "
        f"{r['publisher']['stall_s']:>8.1f}"
    )


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    base = results.get("plain", {}).get("tok_per_s")
    s: dict[str, Any] = {
        "model": "tiny-llama" if args.tiny else "llama-3-8b-shape-dummy-bf16",
        "prompts": args.prompts,
        "input": args.input,
        "output": args.output,
        "layer": args.layer,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "queue_mb": args.queue_mb,
        "drop_duty": args.drop_duty,
        "sae_batch_tokens": args.sae_batch_tokens,
        "mps": args.mps,
        "trainer_gpu": args.trainer_gpu,
        "sink": " ".join(sink_flags(args)),
        "wandb": "offline" if has_wandb() else "skipped: not installed",
    }
    for name, r in results.items():
        s[f"tok_per_s_{name}"] = r["tok_per_s"]
        s[f"gen_s_{name}"] = r["gen_s"]
        s[f"engine_start_s_{name}"] = r["engine_start_s"]
        s[f"served_{name}"] = r["served_rows"]
        if "gpu_total_mib" in r:
            s["gpu_total_mib"] = r["gpu_total_mib"]
            s["engine_budget_mib"] = round(r["gpu_total_mib"] * args.gpu_memory_utilization)
            s[f"gpu_used_peak_mib_{name}"] = r["gpu_used_peak_mib"]
        if ARMS[name] is not None:
            s[f"ratio_engine_{name}"] = round(r["tok_per_s"] / base, 4) if base else None
        if "sink" in r:
            s[f"sink_rows_{name}"] = r["sink"]["rows_written"]
            s[f"sink_bytes_{name}"] = r["sink"]["bytes"]
            s[f"sink_shards_{name}"] = r["sink"]["shards"]
        if "wandb" in r:
            s[f"wandb_runs_{name}"] = r["wandb"]["runs"]
        if c := r.get("cost"):
            s.update({f"{k}_{name}": v for k, v in c.items() if k != "steps"})
        if "publisher" in r:
            s[f"stall_s_{name}"] = r["publisher"]["stall_s"]
            s[f"source_drops_{name}"] = r["publisher"]["source_drops"]
        t = r.get("trainer")
        if t is None:
            continue
        s[f"trained_{name}"] = t["tokens_trained"]
        s[f"trained_share_{name}"] = round(t["tokens_trained"] / r["served_rows"], 4)
        s[f"received_{name}"] = t["rows_received"]
        # under block every served row must reach the trainer: a check of the count
        s[f"received_equals_served_{name}"] = t["rows_received"] == r["served_rows"]
        s[f"drops_{name}"] = t["missed"]
        s[f"publisher_dropped_{name}"] = t["publisher_dropped"]
        s[f"overflow_{name}"] = t["overflow"]
        s[f"trainer_steps_{name}"] = t["steps"]
        s[f"trainer_duty_{name}"] = t["duty"]
        s[f"trainer_tok_per_s_{name}"] = t["tok_per_s"]
        s[f"trainer_train_s_{name}"] = t["train_s"]
        s[f"trainer_after_generation_s_{name}"] = t["after_generation_s"]
        s[f"trainer_peak_allocated_mib_{name}"] = t["peak_allocated_mib"]
        s[f"trainer_peak_reserved_mib_{name}"] = t["peak_reserved_mib"]
        s[f"trainer_smi_peak_mib_{name}"] = t["smi_peak_mib"]
        s[f"trainer_fvu_{name}"] = t["fvu"]
    s["targets"] = TARGETS
    for key, bar in TARGETS.items():
        if s.get(key) is not None:
            s[f"{key}_met"] = s[key] >= bar
    return s


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == TRAINER_STATS:
        return trainer_main(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny Llama")
    ap.add_argument("--prompts", type=int, default=None, help="2048 (--tiny: 16)")
    ap.add_argument("--input", type=int, default=None, help="prompt tokens: 256 (--tiny: 32)")
    ap.add_argument("--output", type=int, default=None, help="new tokens: 256 (--tiny: 32)")
    ap.add_argument("--layer", type=int, default=None, help="tapped layer: 16 (--tiny: 3)")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="the engine's share, every arm: 0.6 (the rest for the trainer; --tiny: 0.3)",
    )
    ap.add_argument(
        "--sink-every", type=int, default=None, help="the fs sink keeps every N-th step: 64 (4)"
    )
    ap.add_argument("--queue-mb", type=int, default=1024, help="the publisher's queue_mb")
    ap.add_argument(
        "--sae-batch-tokens", type=int, default=None, help="the trainer's rows a step: 8192 (4096)"
    )
    ap.add_argument(
        "--mps",
        action="store_true",
        help="run every arm, plain included, under an MPS daemon of its own (benchmarks/mps.py)",
    )
    ap.add_argument(
        "--trainer-gpu",
        type=int,
        default=None,
        help="run the trainer, sink and W&B on this visible GPU (e.g. 1), the engine alone on "
        "the first; default: all on the first GPU",
    )
    ap.add_argument(
        "--drop-duty",
        type=float,
        default=0.02,
        help="the drop arm's trainer --max-duty (1: no cap, it trains as much as it keeps up with)",
    )
    ap.add_argument(
        "--arms",
        default="plain,block,drop",
        help="arms to run, in order; also drop_sae (the trainer alone) and side (the sink "
        "and W&B alone), both drop_oldest",
    )
    ap.add_argument("--work", default=None, help="keep every arm's files here (default: a temp)")
    ap.add_argument("--subscribe-timeout", type=float, default=300.0)
    ap.add_argument("--consumer-timeout", type=float, default=600.0)
    ap.add_argument("--arm-timeout", type=float, default=1200.0)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k, v in DEFAULTS["tiny" if args.tiny else "gpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one:
        print("RESULT " + json.dumps(run_arm(args.one, args)), flush=True)
        return 0

    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    keep = args.work is not None
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-journey-"))
    if not has_wandb():
        print("wandb is not installed: the wandb consumer is skipped", flush=True)
    results: dict[str, dict[str, Any]] = {}
    timed_out: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        if not keep:  # callbacks run last-in first-out: the daemon stops before this
            stack.callback(shutil.rmtree, work, ignore_errors=True)
        mps_env = stack.enter_context(mps_daemon(work)) if args.mps else {}
        for name in arms:
            env = {**os.environ, **mps_env}
            env["VLLM_PLUGINS"] = "actbus" if ARMS[name] else "no-plugin"
            # the same flags (so the same defaults), one arm, every arm's files under work
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name, "--work", str(work)]
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=args.arm_timeout, cwd=ROOT
                )
            except subprocess.TimeoutExpired as e:  # reported; the other arms still run
                out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else ""
                print(f"arm {name} timed out after {args.arm_timeout:.0f} s:", out[-2000:])
                timed_out[f"timed_out_{name}"] = args.arm_timeout
                continue
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"arm {name} failed")
            results[name] = json.loads(line[-1][len("RESULT ") :])
            r = results[name]
            print(
                f"  {name:8s} {r['tok_per_s']:>10.1f} tok/s  ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )

    base = results.get("plain", {}).get("tok_per_s")
    print(
        f"\n{'arm':8s} {'gen tok/s':>10s} {'vs plain':>7s} {'served':>11s} {'trained':>11s} "
        f"{'share':>7s} {'drops':>7s} {'train tok/s':>11s} {'peak GiB':>9s} {'stall s':>8s}"
    )
    for name, r in results.items():
        print(_row(name, r, base))
    for name, r in results.items():
        if c := r.get("cost"):
            cpu = ", ".join(f"{n} {v} s" for n, v in c["consumer_cpu_s"].items())
            print(
                f"{name}: per step, actbus on the engine thread {c['capture_ms_per_step']} ms, "
                f"publisher thread {c['publisher_cpu_ms_per_step']} ms CPU; consumers' CPU "
                f"during generation: {cpu}"
            )
    s = summarize(results, args)
    if "engine_budget_mib" in s:
        print(
            f"GPU memory: {s['gpu_total_mib'] / 1024:.1f} GiB; the engine's share "
            f"{args.gpu_memory_utilization} = {s['engine_budget_mib'] / 1024:.1f} GiB; the "
            "trainer's peak allocation per arm above"
        )
    for key, bar in TARGETS.items():
        if key in s and s[key] is not None:
            ok = "met" if s[key] >= bar else "MISSED"
            print(f"target {key} >= {bar}: {s[key]} ({ok})")
    print(f"wandb: {s['wandb']}; sink: {s['sink']}")
    print(json.dumps({**s, **timed_out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
