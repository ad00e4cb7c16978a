"""The front end's returned-scores path alone, fed real monitor messages (CPU, no engine).

A publisher in a child process sends what an engine with a probe monitor at TAPS
layers would for REQUESTS requests that ask for their scores back
(``"monitor_return": true``): prefill in chunks of CHUNK requests per step, then one
score per request per step and layer (one message per (monitor, layer) per step, as
``actbus.monitor.worker`` publishes them), request ends on the next step. This
process runs the front end's ``ScoreCollector`` and takes each request's final output
as vLLM's output processor does, in the order the requests finish (``--delta``: a
DELTA output per request per step too, as ``AsyncLLM`` streaming does). Every score
is checked against what was sent, after the timing.

The figure that matters is the receiving thread's CPU time per engine step (from
/proc; user time is mostly Python work that holds the front end's GIL, which vLLM's
output processing needs): at 512 requests a step, the H100 runs a decode step in
about 35 ms. ``--probe`` adds a thread of pure-Python work standing in for the output
processing, and reports how much of its rate it lost (``probe_slowdown``). ``--step-ms 35`` paces
the stream like an engine (step k sent at k x 35 ms, its outputs made at (k + 1) x
35 ms): the time spent making outputs then is mostly final outputs waiting for their
last scores, which holds up vLLM's output processing.

    python benchmarks/bench_score_collector.py [--requests 512 --prompt 256 --gen 256]
    python benchmarks/bench_score_collector.py --profile     # cProfile of this process
    python benchmarks/bench_score_collector.py --bus         # a bare subscriber instead

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_return_collector import Probe, _figures, _thread_cpu  # noqa: E402

LAYER_STEP = 8
NAME = "probe"


def _plan(args: argparse.Namespace) -> list[tuple[list[tuple[int, list[int]]], list[int]]]:
    """Per step: (request, positions fed) pairs, and the requests that ended before it."""
    steps: list[tuple[list[tuple[int, list[int]]], list[int]]] = []
    fed = [0] * args.requests
    waiting = list(range(args.requests))
    running: list[int] = []
    ended_last: list[int] = []
    while running or waiting or ended_last:
        rows = [(r, [fed[r]]) for r in running]
        for r in running:
            fed[r] += 1
        new, waiting = waiting[: args.chunk], waiting[args.chunk :]
        for r in new:
            rows.append((r, list(range(args.prompt))))
            fed[r] = args.prompt
        running += new
        steps.append((rows, ended_last))
        ended_last = [r for r in running if fed[r] == args.prompt + args.gen - 1]
        running = [r for r in running if fed[r] < args.prompt + args.gen - 1]
    return steps


def _value(r: int, positions: np.ndarray, layer_index: int) -> np.ndarray:
    """Exact in float32: names the request, position and layer of every score."""
    return (positions * 1024 + r + layer_index * (1 << 20)).astype(np.float32)


def publisher_main(args: argparse.Namespace) -> int:
    from actbus.bus import Publisher
    from actbus.wire import MONITOR_HOOK, Header, MonitorInfo, RequestEnd, RowIndex

    pub = Publisher(
        args.address,
        info={"model": "m", "hidden_size": 64, "dtype": "float32"},
        queue_bytes=1 << 30,
    )
    plan = _plan(args)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    t0 = time.monotonic()
    for step, (rows, ended) in enumerate(plan):
        if args.step_ms:  # an engine's pace: step k is sent at k steps' time
            time.sleep(max(0.0, t0 + step * args.step_ms / 1e3 - time.monotonic()))
        ids = [f"r{r}" for r, _ in rows]
        counts = [len(p) for _, p in rows]
        positions = np.concatenate([[], *(p for _, p in rows)]).astype(np.int64)
        req = np.repeat(np.array([r for r, _ in rows], dtype=np.int64), counts)
        ends = [RequestEnd(f"r{r}", 0, "length") for r in ended]
        for li in range(args.taps):
            ri = RowIndex(  # the worker makes one index per (monitor, layer)
                ids,
                np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                positions,
                positions + 7,
                sample_index=[0] * len(ids),
                returned=[True] * len(ids),
            )
            x = torch.from_numpy(_value(req, positions, li)).reshape(-1, 1)
            x = x.expand(-1, args.width).contiguous()
            hdr = Header(
                step, li * LAYER_STEP, MONITOR_HOOK, "float32", tuple(x.shape), "m", ri,
                ended=ends, monitor=MonitorInfo(NAME, 1, "post_block", ()),
            )  # fmt: skip
            pub.publish(hdr, x)
    sys.stdin.readline()  # done
    pub.close()
    return 0


def _start_publisher(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--publisher", "--address", args.address]
    for k in ("requests", "prompt", "gen", "chunk", "taps", "width", "step_ms"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _tell(proc: subprocess.Popen, what: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(what + "\n")
    proc.stdin.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from actbus.monitor.returns import ScoreCollector

    plan = _plan(args)
    proc = _start_publisher(args)
    col = ScoreCollector([args.address])
    streams = tuple((NAME, li * LAYER_STEP) for li in range(args.taps))
    for r in range(args.requests):
        col.expect(f"r{r}", 1, streams, args.prompt, max_tokens=args.gen)
    prof = cProfile.Profile() if args.profile else None
    pieces: dict[int, list[Any]] = {r: [] for r in range(args.requests)}
    generated = [0] * args.requests
    finals: list[int] = []
    probe = Probe() if args.probe else None
    alone = probe.rate(1.0) if probe else 0.0
    n0 = probe.count if probe else 0
    tid = col._thread.native_id
    th0 = _thread_cpu(tid)
    _tell(proc, "go")
    t0, c0 = time.monotonic(), time.process_time()
    take_s = 0.0
    if prof:
        prof.enable()
    for step, (rows, _) in enumerate(plan):
        if args.step_ms:  # step k's outputs come when the engine has run it
            time.sleep(max(0.0, t0 + (step + 1) * args.step_ms / 1e3 - time.monotonic()))
        for r, _pos in rows:
            generated[r] += 1
            final = generated[r] == args.gen
            if not final and not args.delta:
                continue
            t1 = time.perf_counter()
            out = col.take(f"r{r}", 0, generated[r], final=final, delta=args.delta)
            take_s += time.perf_counter() - t1
            pieces[r].append(out)
            if final:
                finals.append(r)
    elapsed, cpu = time.monotonic() - t0, time.process_time() - c0
    thread = _thread_cpu(tid) - th0
    loops = (probe.count - n0) if probe else 0
    if probe:
        probe.stop()
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    stats = getattr(col, "stats", lambda: {})()
    col.close()
    _tell(proc, "done")
    proc.wait(timeout=60)
    checked = sum(_check(r, pieces[r], args) for r in finals)
    assert len(finals) == args.requests, len(finals)
    out = _figures(elapsed, cpu, thread, alone, loops)
    steps = len(plan)
    out |= {
        "steps": steps,
        "recv_ms_per_step": round(1e3 * float(thread[0] + thread[1]) / steps, 3),
        "take_ms_per_step": round(1e3 * take_s / steps, 3),
        "scores_checked": checked,
    }
    return out | {f"col_{k}": v for k, v in stats.items()}


def run_bus(args: argparse.Namespace) -> dict[str, Any]:
    """The same stream to a bare ``block`` subscriber on a thread of this process that
    only receives (the collector's subscription): the bus' own share of the cost."""
    from actbus.bus import Subscriber, Subscription
    from actbus.bus.subscriber import Batch
    from actbus.wire import MONITOR_HOOK

    steps = len(_plan(args))
    n = steps * args.taps
    proc = _start_publisher(args)
    sub = Subscriber(
        args.address, Subscription(policy="block", hooks=(MONITOR_HOOK,), returned_only=True)
    )
    sub.wait_welcome(30)
    got = [0]

    def receive() -> None:
        while got[0] < n:
            out = sub.recv(timeout=30)
            if out is None:
                raise SystemExit(f"the bus subscriber got {got[0]} of {n} messages")
            got[0] += isinstance(out, Batch)

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    th0 = thread = _thread_cpu(th.native_id)
    _tell(proc, "go")
    t0, c0 = time.monotonic(), time.process_time()
    while th.is_alive():
        th.join(0.005)
        if th.is_alive():  # a finished thread's figures are gone from /proc
            thread = _thread_cpu(th.native_id)
    elapsed, cpu = time.monotonic() - t0, time.process_time() - c0
    sub.close()
    _tell(proc, "done")
    proc.wait(timeout=60)
    out = _figures(elapsed, cpu, thread - th0, 0.0, 0)
    ms = round(1e3 * float(thread[0] + thread[1] - th0[0] - th0[1]) / steps, 3)
    return out | {"steps": steps, "recv_ms_per_step": ms, "messages": got[0]}


def _check(r: int, pieces: list[Any], args: argparse.Namespace) -> int:
    want = args.prompt + args.gen - 1
    assert pieces[-1].complete, f"request {r}: not complete"
    # An output made before any score came has no rows (and no width yet).
    pieces = [p for p in pieces if len(p.positions)] or pieces[-1:]
    pos = torch.cat([p.positions for p in pieces]) if args.delta else pieces[-1].positions
    assert pos.tolist() == list(range(want)), f"request {r}: positions"
    tok = torch.cat([p.token_ids for p in pieces]) if args.delta else pieces[-1].token_ids
    assert (tok == pos + 7).all(), f"request {r}: token ids"
    for li in range(args.taps):
        key = (NAME, li * LAYER_STEP)
        v = torch.cat([p.values[key] for p in pieces]) if args.delta else pieces[-1].values[key]
        assert v.shape == (want, args.width), (r, key, v.shape)
        expect = torch.from_numpy(_value(r, pos.numpy(), li))
        assert torch.equal(v[:, 0], expect), (r, key)
    return want * args.taps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32, help="requests prefilled per step")
    ap.add_argument("--taps", type=int, default=4, help="layers of the monitor")
    ap.add_argument("--width", type=int, default=1, help="scores per row (1: a probe)")
    ap.add_argument("--delta", action="store_true", help="a DELTA output every step")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--probe", action="store_true", help="a GIL probe thread")
    ap.add_argument("--bus", action="store_true", help="a bare subscriber instead")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="send a step every this many ms, and make its outputs one step later "
        "(0: as fast as the subscriber takes them)",
    )
    ap.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publisher:
        return publisher_main(args)
    args.address = f"ipc://{tempfile.mkdtemp(prefix='bench-scores-')}/bus.sock"
    out: dict[str, Any] = {
        k: getattr(args, k) for k in ("requests", "prompt", "gen", "chunk", "taps", "width")
    }
    out["delta"] = args.delta
    if args.bus:
        r = run_bus(args)
        print(f"\nbare subscriber: {r['recv_ms_per_step']:.2f} ms per step")
        print(json.dumps(out | {f"bus_{k}": v for k, v in r.items()}))
        return 0
    r = run(args)
    print(
        f"\n{r['steps']} steps in {r['s']:.2f} s; receiving thread "
        f"{r['recv_user_s']:.2f} s user + {r['recv_sys_s']:.2f} s system = "
        f"{r['recv_ms_per_step']:.2f} ms per step; outputs {r['take_ms_per_step']:.2f} ms "
        "per step" + (f"; probe slowdown {r['probe_slowdown']:.3f}" if args.probe else "")
    )
    print(json.dumps(out | r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
