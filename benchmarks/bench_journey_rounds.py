"""Where the journey's cost lies: one engine, the journey's consumers one set at a time.

``bench_journey.py`` gives each arm its own engine, so its ratios carry the spread
between engine instances (plain ran at 9,884 and 10,910 tok/s in two leases). Here one
engine, actbus loaded, tapping the journey's layer, serves the same prompts in rounds;
before each round a set of consumers starts and subscribes, after it they are stopped
(SIGTERM: the trainer saves and exits). Every round is compared with ``idle`` (nothing
subscribed), measured first and again last to show drift:

    idle        nothing subscribed (capture runs, nothing is sent)
    sink        the journey's fs sink (every 64th step, int8)
    sink_spin   the same with torch's idle CPU workers spinning, as before actbus's
                commands set OMP_WAIT_POLICY=PASSIVE (GOMP_SPINCOUNT=300000)
    null        a null consumer taking every step (drop_oldest): the bus at full rate
    wandb       the journey's W&B dashboard, offline (its default policy, sample:5/s)
    side        the drop arm's consumers beside its trainer: the fs sink and W&B
    sae_drop    the journey's trainer, drop_oldest at --max-duty 0.02
    sae_block   the journey's trainer under block
    sae_block_spin the same with idle CPU workers spinning (GOMP_SPINCOUNT=300000)

Per round: generated tok/s and its ratio to ``idle``, each consumer's CPU seconds
during the generation, actbus's time on the engine thread per step, the publisher's
stall. Prints a table, then one JSON line (``ratio_<round>`` for each).

    python benchmarks/bench_journey_rounds.py [--prompts 1024] [--rounds idle,sink,...]
    python benchmarks/bench_journey_rounds.py --tiny    # CPU smoke test

``--mps`` runs the engine and every consumer under an MPS daemon of its own
(``benchmarks/mps.py``); the trainer takes ``--sae-batch-tokens`` rows a step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks import bench_journey as bj  # noqa: E402
from benchmarks.engine_arms import engine_cost, engine_counters  # noqa: E402
from benchmarks.mps import mps_daemon  # noqa: E402

ROUNDS: dict[str, tuple[tuple[str, str], ...]] = {
    # round -> (consumer, its policy) pairs; the sae's policy picks block or drop_oldest
    "idle": (),
    "sink": (("fs-sink", ""),),
    "sink_spin": (("fs-sink", ""),),
    "null": (("null", "drop_oldest"),),
    "wandb": (("wandb", ""),),
    "side": (("fs-sink", ""), ("wandb", "")),
    "sae_drop": (("sae", "drop_oldest"),),
    "sae_block": (("sae", "block"),),
    "sae_block_spin": (("sae", "block"),),
}
SPIN = {"GOMP_SPINCOUNT": "300000"}
"""GNU OpenMP's own default, which overrides the OMP_WAIT_POLICY=PASSIVE that actbus's
commands start with: the ``_spin`` rounds' consumers, as before that change."""


def _start(rnd: str, address: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The round's consumers, started; returns name -> process."""
    from actbus.cli import consumer_command

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    if rnd.endswith("_spin"):
        env |= SPIN
    procs = {}
    for name, policy in ROUNDS[rnd]:
        log = work / f"{rnd}-{name}.log"
        if name == "fs-sink":
            cmd = consumer_command(
                "fs-sink", address, "--out", str(work / f"{rnd}-run"), "--layers",
                str(args.layer), "--hooks", "post_block", *bj.sink_flags(args),
            )  # fmt: skip
        elif name == "wandb":  # offline, every 2 s, as in bench_journey
            cmd = consumer_command(
                "wandb", address, "--interval", "2", "--wandb-dir", str(work / rnd)
            )
        elif name == "null":
            cmd = consumer_command("null", address, "--policy", policy)  # every tapped layer
        else:
            cmd = [
                sys.executable, "-m", "actbus.cli", "run", "sae", "--connect", address,
                "--layer", str(args.layer), "--hook", "post_block", "--policy", policy,
                "--out", str(work / f"{rnd}-saes"), "--summary", str(work / f"{rnd}-sae.json"),
                "--no-progress", *bj.sae_flags(args),
            ]  # fmt: skip
            if policy != "block":
                cmd += ["--max-duty", str(args.drop_duty)]
        procs[name] = bj._spawn(cmd, log, env)
    return procs


def run_rounds(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    import common  # examples/common.py

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-rounds-"))
    model_dir, vocab = bj._model(args, work)
    address = f"ipc://{tempfile.mkdtemp(prefix='actbus-rounds-')}/bus.sock"
    t0 = time.monotonic()
    extra = {"actbus": {"publish": address, "layers": [args.layer], "queue_mb": args.queue_mb}}
    llm, prompts, sp = bj.engine(args, model_dir, vocab, extra)
    print(f"engine up in {time.monotonic() - t0:.0f} s", flush=True)

    results: dict[str, dict[str, Any]] = {}
    for rnd in args.rounds:
        label = rnd if rnd not in results else f"{rnd}_end"
        procs = _start(rnd, address, args, work)
        deadline = time.monotonic() + args.subscribe_timeout
        while procs and not set(procs) <= set(common.subscribers(address)):
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                logs = {n: (work / f"{rnd}-{n}.log").read_text()[-2000:] for n in procs}
                raise SystemExit(f"{rnd}: not subscribed (exited: {dead})\n{json.dumps(logs)}")
            time.sleep(1.0)
        before = engine_counters(address)
        cpu0 = {n: bj._cpu_s(p.pid) for n, p in procs.items()}
        t0 = time.monotonic()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        gen_s = time.monotonic() - t0
        cost = engine_cost(before, engine_counters(address))
        published = cost["steps"] > 0
        cpu = {n: round(bj._cpu_s(p.pid) - cpu0[n], 2) for n, p in procs.items()}
        stall = bj._publisher_stats(address)["stall_s"]
        rcs = {n: common.finish(p, args.consumer_timeout, signal.SIGTERM) for n, p in procs.items()}
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        r = {
            "tok_per_s": round(generated / gen_s, 1),
            "gen_s": round(gen_s, 2),
            "consumer_cpu_s": cpu,
            # per published step: none while nothing is subscribed (no step is counted)
            "capture_ms_per_step": cost["capture_ms_per_step"] if published else None,
            "publisher_cpu_ms_per_step": cost["publisher_cpu_ms_per_step"] if published else None,
            "stall_s": stall,
            "exit_codes": rcs,
        }
        summary = work / f"{rnd}-sae.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            r["trained"] = int(sum(v for k, v in s["data"].items() if k.startswith("tokens/")))
            r["trainer_steps"] = s["steps"]
        results[label] = r
        print(f"  {label:14s} {r['tok_per_s']:>10.1f} tok/s  cpu {cpu}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny Llama")
    ap.add_argument("--prompts", type=int, default=None, help="1024 (--tiny: 16)")
    ap.add_argument(
        "--rounds",
        default="idle,sink,sink_spin,null,sae_drop,sae_block,sae_block_spin,idle",
        help=f"rounds in order, from {list(ROUNDS)}; a repeated one is reported as NAME_end",
    )
    ap.add_argument("--drop-duty", type=float, default=0.02)
    ap.add_argument("--sae-batch-tokens", type=int, default=None, help="8192 (--tiny: 4096)")
    ap.add_argument("--mps", action="store_true", help="engine and consumers under MPS")
    ap.add_argument("--queue-mb", type=int, default=1024)
    ap.add_argument("--work", default=None)
    ap.add_argument("--subscribe-timeout", type=float, default=120.0)
    ap.add_argument("--consumer-timeout", type=float, default=60.0)
    args = ap.parse_args()
    defaults = dict(bj.DEFAULTS["tiny" if args.tiny else "gpu"])
    defaults["prompts"] = 16 if args.tiny else 1024
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.rounds = args.rounds.split(",")
    unknown = [r for r in args.rounds if r not in ROUNDS]
    if unknown:
        ap.error(f"--rounds: unknown {unknown}; choose from {list(ROUNDS)}")
    os.environ["VLLM_PLUGINS"] = "actbus"
    with contextlib.ExitStack() as stack:
        if args.mps:  # this process runs the engine: its own environment first
            os.environ.update(stack.enter_context(mps_daemon(Path(tempfile.mkdtemp()))))
        results = run_rounds(args)
    base = results[args.rounds[0]]["tok_per_s"]
    print(f"\n{'round':14s} {'tok/s':>10s} {'vs first':>8s} {'engine ms':>9s} {'stall s':>8s}  "
          "consumers' CPU s")  # fmt: skip
    out: dict[str, Any] = {"prompts": args.prompts, "layer": args.layer, "mps": args.mps,
                           "sae_batch_tokens": args.sae_batch_tokens}  # fmt: skip
    for label, r in results.items():
        ratio = r["tok_per_s"] / base
        ms = "-" if r["capture_ms_per_step"] is None else f"{r['capture_ms_per_step']:.2f}"
        print(
            f"{label:14s} {r['tok_per_s']:>10.1f} {ratio:>8.3f} "
            f"{ms:>9s} {r['stall_s']:>8.1f}  {r['consumer_cpu_s']}"
            + (f"  trained {r['trained']:,}" if "trained" in r else "")
        )
        out[f"tok_per_s_{label}"] = r["tok_per_s"]
        out[f"ratio_{label}"] = round(ratio, 4)
        out[f"consumer_cpu_s_{label}"] = r["consumer_cpu_s"]
        out[f"capture_ms_per_step_{label}"] = r["capture_ms_per_step"]
        if "trained" in r:
            out[f"trained_{label}"] = r["trained"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
