"""fs-sink throughput against plain sequential writes, and what each reduction costs.

In one run, in the same directory (same disk):
    baseline  plain sequential ``write()`` of 2 MiB buffers into files of
              --shard-mb, each fsynced (the sink fsyncs every shard too)
    sink      an ``actbus run fs-sink`` process fed by a real Publisher in this
              process with 2 MiB messages (float32, hidden 4096, 8 requests of 16
              rows), raw dtype, no compression; timed from the first publish until
              the manifest lists every row (all shards fsynced and committed)
Each runs --reps times, interleaved; the median rate is reported, and
``ratio_raw`` = sink / baseline.

Then, smaller and in-process (the storage format, not the bus, is measured), one
run per reduction and compression on synthetic activations (a decaying spectrum
plus a few large outlier dimensions, loosely like a residual stream): bytes per
token on disk and relative L2 error of what a reader decodes (proj:K: the
relative error of row norms, its space being K-dim).

Prints a table, then one JSON line with every figure.

    python benchmarks/bench_sink.py [--gib 1] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from actbus.bus import Batch, Publisher
from actbus.cli import consumer_command
from actbus.wire import Header, RowIndex

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 4096
MSG = 2 << 20
ROWS = MSG // (HIDDEN * 4)  # 128
REQS = 8


def baseline(d: Path, total: int, shard_bytes: int) -> float:
    """Bytes/s of plain sequential write() calls, fsync per file."""
    buf = np.random.default_rng(0).integers(0, 255, MSG, dtype=np.uint8).tobytes()
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    written, i = 0, 0
    while written < total:
        with open(d / f"plain-{i:04d}.bin", "wb") as f:
            in_file = 0
            while in_file < shard_bytes and written < total:
                f.write(buf)
                in_file += MSG
                written += MSG
            f.flush()
            os.fsync(f.fileno())
        i += 1
    dt = time.monotonic() - t0
    shutil.rmtree(d)
    return written / dt


def _index() -> RowIndex:
    per = ROWS // REQS
    return RowIndex(
        [f"req-{i}" for i in range(REQS)],
        np.arange(REQS + 1, dtype=np.int64) * per,
        np.tile(np.arange(per), REQS).astype(np.int64),
        np.arange(ROWS, dtype=np.int64),
    )


def sink_rate(d: Path, total: int, shard_mb: float) -> dict:
    """Bytes/s of activation payload from the first publish to the last commit."""
    out = d / "run"
    addr = f"ipc://{tempfile.mkdtemp()}/bus.sock"
    pub = Publisher(
        addr,
        info={"model": "bench", "hidden_size": HIDDEN, "dtype": "float32"},
        heartbeat_s=0.2,
        queue_bytes=32 * MSG,
    )
    proc = subprocess.Popen(
        consumer_command(
            "fs-sink", addr, "--out", str(out), "--shard-mb", str(shard_mb), "--shard-rows",
            str(1 << 30), "--exit-on-end", "--log-level", os.environ.get("SINK_LOG", "WARNING"),
        ),
        cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pub.stats()["subscribers"]:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the sink did not subscribe")
            time.sleep(0.05)
        tensors = [torch.randn(ROWS, HIDDEN) for _ in range(4)]
        ri = _index()
        n = total // MSG
        t0 = time.monotonic()
        for step in range(n):
            h = Header(step, 0, "post_block", "float32", (ROWS, HIDDEN), "bench", ri)
            pub.publish(h, tensors[step % 4])
        pub.close(timeout=300)  # every message acknowledged, then END: the sink exits
        proc.wait(timeout=300)
        m = json.loads((out / "manifest.json").read_text())
        # the commit time of the last shard: the manifest's mtime
        t_end = os.stat(out / "manifest.json").st_mtime
        dt = t_end - (time.time() - (time.monotonic() - t0))
        rows = m["total_rows"]
        disk = sum(s["bytes"] for s in m["shards"])
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    if rows != n * ROWS:
        raise RuntimeError(f"the sink committed {rows} rows of {n * ROWS}")
    shutil.rmtree(out)
    return {"rate": n * MSG / dt, "seconds": dt, "disk_bytes": disk, "payload_bytes": n * MSG}


def synthetic(rows: int, seed: int) -> torch.Tensor:
    """Decaying spectrum (rank ~64 dominant) plus 4 outlier dims, as float32."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(HIDDEN, 256, generator=torch.Generator().manual_seed(99)))[
        0
    ].T
    scales = 1.0 / (1 + torch.arange(256, dtype=torch.float32)) ** 0.8
    x = (torch.randn(rows, 256, generator=g) * scales) @ basis * 40
    x += 0.05 * torch.randn(rows, HIDDEN, generator=g)
    x[:, :4] += 20 * torch.randn(rows, 1, generator=g).abs()
    return x


def reduction_figures(d: Path, rows: int) -> dict[str, dict]:
    from consumers.fs import ActivationRun, FsSink, WriterConfig, parse_reduction

    specs = [
        ("none", "none"),
        ("none", "zstd"),
        ("none", "lz4"),
        ("fp16", "none"),
        ("bf16", "none"),
        ("int8", "none"),
        ("proj:256", "none"),
        ("pca:256", "none"),
        ("topk:64", "none"),
    ]
    x = synthetic(rows, 0)
    ri = _index()
    out: dict[str, dict] = {}
    for spec, comp in specs:
        run_dir = d / f"red-{spec.replace(':', '_')}-{comp}"
        cfg = WriterConfig(compression=comp, reduction=parse_reduction(spec, seed=1, warmup=4096))
        sink = FsSink(str(run_dir), cfg)
        sink.on_welcome({"model": "bench", "hidden_size": HIDDEN, "dtype": "float32"})
        for i in range(rows // ROWS):
            h = Header(i, 0, "post_block", "float32", (ROWS, HIDDEN), "bench", ri)
            sink.on_batch(Batch(header=h, tensor=x[i * ROWS : (i + 1) * ROWS], seq=i))
        sink.close()
        run = ActivationRun(run_dir)
        table = run.dataset().to_table().sort_by([("step", "ascending")])
        got = run.decode(table).float()
        n = table.num_rows
        if spec.startswith("proj"):
            err = float(((got.norm(dim=1) / x[:n].norm(dim=1)) - 1).abs().mean())
        else:
            err = float((got - x[:n]).norm() / x[:n].norm())
        disk = sum(s["bytes"] for s in run.manifest["shards"])
        name = spec if comp == "none" else f"{spec}+{comp}"
        out[name] = {"bytes_per_token": round(disk / n, 1), "rel_error": round(err, 6)}
        shutil.rmtree(run_dir)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB written per measurement")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shard-mb", type=float, default=256.0)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--reduction-rows", type=int, default=16384)
    args = p.parse_args()
    d = Path(args.dir or tempfile.mkdtemp(prefix="bench_sink-"))
    d.mkdir(parents=True, exist_ok=True)
    total = int(args.gib * (1 << 30))
    shard_bytes = int(args.shard_mb * (1 << 20))
    base, sink = [], []
    for _ in range(args.reps):
        base.append(baseline(d / "plain", total, shard_bytes))
        sink.append(sink_rate(d, total, args.shard_mb))
    b = statistics.median(base)
    s = statistics.median(r["rate"] for r in sink)
    overhead = sink[0]["disk_bytes"] / sink[0]["payload_bytes"]
    red = reduction_figures(d, args.reduction_rows)
    print(f"dir {d}  {args.gib} GiB x {args.reps} reps, 2 MiB messages, hidden {HIDDEN}")
    print(f"{'':28s}{'MB/s median':>12s}  {'all reps':s}")
    print(f"{'baseline write()':28s}{b / 1e6:12.0f}  {[round(x / 1e6) for x in base]}")
    print(f"{'fs-sink from the bus':28s}{s / 1e6:12.0f}  {[round(r['rate'] / 1e6) for r in sink]}")
    print(f"ratio_raw {s / b:.3f}   on-disk bytes / payload {overhead:.4f}")
    print(f"\n{'reduction':20s}{'bytes/token':>12s}{'rel error':>12s}")
    for name, r in red.items():
        print(f"{name:20s}{r['bytes_per_token']:12.1f}{r['rel_error']:12.5f}")
    shutil.rmtree(d, ignore_errors=True)
    print(
        json.dumps(
            {
                "ratio_raw": round(s / b, 4),
                "baseline_mb_s": round(b / 1e6, 1),
                "sink_mb_s": round(s / 1e6, 1),
                "baseline_reps_mb_s": [round(x / 1e6, 1) for x in base],
                "sink_reps_mb_s": [round(r["rate"] / 1e6, 1) for r in sink],
                "disk_over_payload": round(overhead, 5),
                "gib": args.gib,
                "reps": args.reps,
                "hidden": HIDDEN,
                "message_bytes": MSG,
                "reductions": red,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
