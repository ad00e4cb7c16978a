"""What a consumer's idle CPU threads cost the process beside it, spinning or asleep.

A Publisher in this process feeds ``actbus run fs-sink`` at an engine's pace
(``--steps-per-s`` steps of ``--rows`` bf16 rows of hidden 4096, one tap), while a
stand-in for the engine's step loop, a process of its own running a single-threaded
Python loop, counts its iterations. Arms, each ``--seconds`` long, interleaved
``--reps`` times:

    alone   no consumer: the stand-in's rate with the feed alone
    spin    the sink with GNU OpenMP's own default, idle workers spinning after every
            parallel op (``GOMP_SPINCOUNT=300000``, what an unset environment gives)
    quiet   the sink as ``actbus run`` starts it now (``OMP_WAIT_POLICY=PASSIVE``)

Both sinks take the journey's sample (every ``--sink-every``-th step, int8). Reported per
arm: the stand-in's iterations/s (median over reps) and its ratio to ``alone``, and the
sink's CPU seconds per second of feed. Prints a table, then one JSON line.

    python benchmarks/bench_consumer_cpu.py [--seconds 20 --reps 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from actbus.bus import Publisher  # noqa: E402
from actbus.cli import consumer_command  # noqa: E402
from actbus.wire import Header, RowIndex  # noqa: E402

HIDDEN = 4096
ARMS = {"alone": None, "spin": {"GOMP_SPINCOUNT": "300000"}, "quiet": {}}


def _loop(stop: Any, out: Any) -> None:
    """The engine's stand-in: one thread of pure Python, counting."""
    n = 0
    while not stop.is_set():
        for _ in range(10_000):
            n += 1
    out.value = n


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_arm(name: str, args: argparse.Namespace) -> dict[str, float]:
    address = f"ipc://{tempfile.mkdtemp(prefix='bench-cpu-')}/bus.sock"
    pub = Publisher(
        address, info={"model": "bench", "hidden_size": HIDDEN, "dtype": "bfloat16"},
        queue_bytes=1 << 30,
    )  # fmt: skip
    proc = None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    if ARMS[name] is not None:
        cmd = consumer_command(
            "fs-sink", address, "--out", tempfile.mkdtemp(prefix="bench-cpu-run-"),
            "--policy", f"sample:{args.sink_every}", "--reduce", "int8",
        )  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **ARMS[name]})
        deadline = time.monotonic() + 60
        while not pub.stats()["subscribers"]:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{name}: the sink did not subscribe")
            time.sleep(0.05)
    reqs = args.rows // 2
    index = RowIndex(
        [f"r{i}" for i in range(reqs)],
        np.arange(reqs + 1, dtype=np.int64) * 2,
        np.tile(np.arange(2), reqs).astype(np.int64),
        np.arange(args.rows, dtype=np.int64),
    )
    x = torch.randn(args.rows, HIDDEN).bfloat16()
    stop, count = mp.Event(), mp.Value("q", 0)
    loop = mp.Process(target=_loop, args=(stop, count))
    loop.start()
    time.sleep(0.5)
    cpu0 = _cpu_s(proc.pid) if proc else 0.0
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < args.seconds:
        pub.publish(Header(step, 16, "post_block", "bfloat16", x.shape, "bench", index), x)
        step += 1
        time.sleep(max(0.0, t0 + step / args.steps_per_s - time.monotonic()))
    stop.set()
    dt = time.monotonic() - t0
    loop.join(timeout=30)
    cpu = (_cpu_s(proc.pid) - cpu0) if proc else 0.0
    pub.close(timeout=10)
    if proc:
        proc.terminate()
        proc.wait(timeout=60)
    return {"loop_per_s": count.value / dt, "sink_cpu_per_s": cpu / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps-per-s", type=float, default=40.0)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--sink-every", type=int, default=64)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    for rep in range(args.reps):
        for arm in ARMS:
            runs[arm].append(run_arm(arm, args))
            print(f"  rep {rep} {arm:6s} {runs[arm][-1]}", flush=True)
    med = {a: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for a, rs in runs.items()}
    base = med["alone"]["loop_per_s"]
    print(f"\n{'arm':6s} {'stand-in it/s':>14s} {'vs alone':>8s} {'sink CPU s/s':>12s}")
    out: dict[str, Any] = {"cpus": os.cpu_count(), "seconds": args.seconds, "reps": args.reps}
    for arm, m in med.items():
        ratio = m["loop_per_s"] / base
        print(f"{arm:6s} {m['loop_per_s']:>14,.0f} {ratio:>8.3f} {m['sink_cpu_per_s']:>12.3f}")
        out[f"loop_per_s_{arm}"] = round(m["loop_per_s"])
        out[f"ratio_{arm}"] = round(ratio, 4)
        out[f"sink_cpu_per_s_{arm}"] = round(m["sink_cpu_per_s"], 4)
    out["sink_cpu_ratio_quiet_vs_spin"] = round(
        med["quiet"]["sink_cpu_per_s"] / max(med["spin"]["sink_cpu_per_s"], 1e-9), 4
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
