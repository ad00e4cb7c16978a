"""Fan-in throughput: N publishers into one subscriber vs one publisher, same bytes.

For each N in --fanin (default 2,4), in one run: N synthetic publisher processes
(as in bench_bus.py: float32 [rows, 4096] messages of --size MiB) each send 1/N of
--gib GiB to one `null` consumer process, policy block, that reads them all with
`--connect A,B,...` (a ``FanIn``); the baseline is the same bytes from one publisher
into the same consumer with `--connect A` (a plain ``Subscriber``). The rate is
measured at the consumer, first to last byte, after every publisher was subscribed
and told to start at once. Reps are interleaved and each ratio (fan-in over that
rep's baseline) is taken within its rep; medians are reported, as in bench_bus.py.
Prints a table, then one JSON line with ``ratio_fanin_N`` for each N.

    python benchmarks/bench_fanin.py [--fanin 2,4] [--size 2] [--gib 0.5] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from actbus.cli import consumer_command

ROOT = Path(__file__).resolve().parents[1]

_PUBLISHER = """
import gc, sys, time
import numpy as np, torch
from actbus.bus import Publisher
from actbus.wire import Header, RowIndex
addr, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
HIDDEN = 4096
gc.freeze()
pub = Publisher(addr, info={"model": "bench"}, queue_bytes=8 * size, heartbeat_s=0.2)
rows = size // (HIDDEN * 4)
tensor = torch.ones(rows, HIDDEN)
ri = RowIndex(["r"], np.array([0, rows]), np.arange(rows), np.arange(rows))
while not pub.stats()["subscribers"]:
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.readline()  # go: every publisher starts together
for step in range(count):
    pub.publish(Header(step, 0, "post_block", "float32", (rows, HIDDEN), "bench", ri), tensor)
while sum(v["sent"] for v in pub.stats()["subscribers"].values()) < count:
    time.sleep(0.01)
pub.close(timeout=30)
"""


def one_run(n: int, size: int, total: int) -> dict:
    """``n`` publishers sending ``total`` messages of ``size`` bytes between them."""
    tmp = tempfile.mkdtemp()
    addrs = [f"ipc://{tmp}/pub-{i}.sock" for i in range(n)]
    counts = [total // n + (i < total % n) for i in range(n)]
    pubs = [
        subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER, a, str(size), str(c)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for a, c in zip(addrs, counts, strict=True)
    ]
    sink = subprocess.Popen(
        consumer_command(
            "null", ",".join(addrs), "--exit-on-end", "--policy", "block", "--log-level", "WARNING"
        ),
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        for p in pubs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a publisher did not start")
        for p in pubs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out, _ = sink.communicate(timeout=600)
        for p in pubs:
            p.wait(timeout=60)
    finally:
        for p in (*pubs, sink):
            if p.poll() is None:
                p.kill()
    r = json.loads(out.strip().splitlines()[-1])
    if r["messages"] != total:
        raise RuntimeError(f"the consumer got {r['messages']} messages of {total}")
    return {"gbps": r["bytes"] / r["seconds"] / 1e9}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fanin", default="2,4", help="publisher counts to compare with one")
    ap.add_argument("--size", type=int, default=2, help="message size, MiB")
    ap.add_argument("--gib", type=float, default=0.5, help="data per measurement, GiB")
    ap.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported")
    args = ap.parse_args()
    ns = [int(x) for x in args.fanin.split(",")]
    size = args.size << 20
    total = max(8 * max(ns), int(args.gib * (1 << 30) / size))
    runs: dict[int, list[dict]] = {n: [] for n in (1, *ns)}
    for _ in range(args.reps):  # interleaved: each rep's ratios are taken within it
        for n in runs:
            runs[n].append(one_run(n, size, total))
    print(f"{'publishers':>10s} {'GB/s':>7s} {'ratio':>6s} {'per-rep ratios':>32s}")
    summary: dict = {"size_mib": args.size, "gib": args.gib, "reps": args.reps}
    for n, rs in runs.items():
        ratios = [r["gbps"] / b["gbps"] for r, b in zip(rs, runs[1], strict=True)]
        gbps = _median([r["gbps"] for r in rs])
        each = " ".join(f"{x:.2f}" for x in ratios)
        print(f"{n:>10d} {gbps:>7.2f} {_median(ratios):>6.2f} {each:>32s}")
        summary[f"gbps_{n}"] = round(gbps, 3)
        if n > 1:
            summary[f"ratio_fanin_{n}"] = round(_median(ratios), 3)
            summary[f"ratios_fanin_{n}"] = [round(x, 3) for x in ratios]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
