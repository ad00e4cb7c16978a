"""The front end's return path alone, fed real wire messages (CPU, no engine).

A publisher in a child process sends what an offline engine would for REQUESTS
requests returning every position at TAPS taps (prefill in chunks of CHUNK requests
per step, then one row per request per step, request ends on the next step), as fast
as a lossless subscriber's credit allows. This process runs the front end's
``ReturnCollector`` and takes each request's final output as the front end does,
in the order the requests finish (``--delta``: a DELTA output per request per step
too, as ``AsyncLLM`` streaming does). Every row is checked bitwise against what was
sent. A second run of the same stream goes to a plain ``block`` subscriber that only
receives: the bus' cost, for comparison.

The collector runs twice on the same stream: ``per_request`` (the previous way: a
Python call per request per message writes its rows) and ``batched`` (a decode step's
single rows written with one numpy scatter per slab); ``bus`` is a bare subscriber on
a thread of this process, only receiving. The receiving thread's own CPU seconds (user
and system apart) and minor page faults are read from /proc: system time there is
mostly the first touch of fresh buffer memory, and numpy copies (user time too) run
without the GIL; the rest of the user time is Python work that holds it.

``--probe`` adds a thread that stands in for vLLM's output processing, which shares
the front end's GIL: it runs a pure-Python loop throughout. The stream's seconds then
say how well the return path keeps up with a busy front end (each time the receiving
thread lets go of the GIL it may wait a switch interval to get it back), and
``probe_slowdown`` (its loop rate during the stream against just before) how much it
lost: to the GIL, and, on a machine without free cores, to the CPU as well.

Prints a table and ends with one JSON line: per arm, seconds
from the first message to the last final output, this process' CPU seconds over that
time, the receiving thread's user and system seconds and page faults, the probe's
share (``--probe``); the rows checked (after the timing).

    python benchmarks/bench_return_collector.py [--requests 64 --prompt 128 --gen 128]
    python benchmarks/bench_return_collector.py --arms batched --profile   # cProfile
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
from inspect import signature
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYER_STEP = 8
ARMS = ("per_request", "batched", "bus")


def _plan(args: argparse.Namespace) -> list[tuple[list[tuple[int, list[int]]], list[int]]]:
    """Per step: (request, positions fed) pairs, and the requests that ended before it."""
    steps: list[tuple[list[tuple[int, list[int]]], list[int]]] = []
    fed = [0] * args.requests  # positions fed so far
    started: list[int] = []
    done: set[int] = set()
    ended_last: list[int] = []
    while len(done) < args.requests or ended_last:
        rows = []
        for r in started:
            if r not in done:
                rows.append((r, [fed[r]]))
                fed[r] += 1
        new = [r for r in range(args.requests) if r not in started][: args.chunk]
        for r in new:
            rows.append((r, list(range(args.prompt))))
            fed[r] = args.prompt
            started.append(r)
        steps.append((rows, ended_last))
        ended_last = []
        for r, _ in rows:  # fed prompt + gen - 1 positions: its last output is out
            if fed[r] == args.prompt + args.gen - 1 and r not in done:
                done.add(r)
                ended_last.append(r)
    return steps


def publisher_main(args: argparse.Namespace) -> int:
    from actbus.bus import Publisher
    from actbus.wire import Header, RequestEnd, RowIndex

    pub = Publisher(
        args.address,
        info={"model": "m", "hidden_size": args.hidden, "dtype": "bfloat16"},
        queue_bytes=1 << 30,
    )
    layers = [LAYER_STEP * i for i in range(args.taps)]
    template = torch.randn(args.prompt * args.chunk + args.requests, args.hidden).to(torch.bfloat16)
    plan = _plan(args)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    for step, (rows, ended) in enumerate(plan):
        ids = [f"r{r}" for r, _ in rows]
        counts = [len(p) for _, p in rows]
        positions = np.concatenate([p for _, p in rows]) if rows else np.zeros(0, np.int64)
        ri = RowIndex(
            ids,
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            positions.astype(np.int64),
            (positions + 7).astype(np.int64),
            returned=[True] * len(ids),
        )
        ends = [RequestEnd(f"r{r}", 0, "length") for r in ended]
        n = len(positions)
        for layer in layers:
            x = template[:n].clone()
            x[:, 0] = torch.from_numpy(positions).to(torch.bfloat16)
            x[:, 1] = torch.tensor([r for r, p in rows for _ in p], dtype=torch.bfloat16)
            x[:, 2] = layer
            hdr = Header(step, layer, "post_block", "bfloat16", tuple(x.shape), "m", ri, ended=ends)
            pub.publish(hdr, x)
    sys.stdin.readline()  # done
    pub.close()
    return 0


def _start_publisher(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--publisher", "--address", args.address]
    for k in ("requests", "prompt", "gen", "chunk", "taps", "hidden"):
        cmd += [f"--{k}", str(getattr(args, k))]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _go(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _finish(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("done\n")
    proc.stdin.flush()
    proc.wait(timeout=60)


class Probe:
    """A thread running pure-Python work, as vLLM's output processing does: its loop
    rate tells how much of the GIL the rest of the process leaves it."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            x = 0
            for i in range(1000):
                x += i
            self.count += 1

    def rate(self, seconds: float) -> float:
        """Loops per second over the next ``seconds``."""
        c0, t0 = self.count, time.monotonic()
        time.sleep(seconds)
        return (self.count - c0) / (time.monotonic() - t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _thread_cpu(native_id: int | None) -> np.ndarray:
    """One thread of this process, from /proc: user s, system s, minor page faults."""
    if native_id is None:
        return np.full(3, np.nan)
    import os

    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return np.array([int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7])])


def run_collector(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    from actbus.capture.returns import ReturnCollector
    from actbus.capture.selection import Selection

    plan = _plan(args)
    proc = _start_publisher(args)
    if hasattr(ReturnCollector, "batched"):  # the code before it had no choice
        ReturnCollector.batched = arm == "batched"
    col = ReturnCollector(args.address)
    layers = tuple(LAYER_STEP * i for i in range(args.taps))
    sel = Selection(layers=layers, hooks=("post_block",))
    # The code before the fast path took no token budget (this script measures both).
    budget = {"max_tokens": args.gen} if "max_tokens" in signature(col.expect).parameters else {}
    for r in range(args.requests):
        col.expect(f"r{r}", 1, sel, args.prompt, **budget)
    # The order in which the front end makes outputs: per step, the requests fed.
    prof = cProfile.Profile() if args.profile else None
    delta_rows: dict[int, list[Any]] = {r: [] for r in range(args.requests)}
    generated = [0] * args.requests
    finals: list[tuple[int, list[Any]]] = []
    probe = Probe() if args.probe else None
    alone = probe.rate(1.0) if probe else 0.0
    n0 = probe.count if probe else 0
    tid = col._thread.native_id
    th0 = _thread_cpu(tid)
    _go(proc)
    t0, c0 = time.monotonic(), time.process_time()
    if prof:
        prof.enable()
    for rows, _ in plan:
        for r, _pos in rows:
            generated[r] += 1
            final = generated[r] == args.gen
            if not final and not args.delta:
                continue
            acts = col.take(f"r{r}", 0, generated[r], final=final, delta=args.delta)
            if args.delta:
                delta_rows[r].append(acts)
            if final:
                finals.append((r, delta_rows[r] if args.delta else [acts]))
    elapsed, cpu = time.monotonic() - t0, time.process_time() - c0
    thread_cpu = _thread_cpu(tid) - th0
    loops = (probe.count - n0) if probe else 0
    if probe:
        probe.stop()
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    col.close()
    _finish(proc)
    checked = sum(_check(r, pieces, args, layers) for r, pieces in finals)
    return _figures(elapsed, cpu, thread_cpu, alone, loops) | {"rows_checked": checked}


def _figures(elapsed: float, cpu: float, thread: np.ndarray, alone: float, loops: int) -> dict:
    out = {
        "s": round(elapsed, 3),
        "cpu_s": round(cpu, 3),
        "recv_user_s": round(float(thread[0]), 3),
        "recv_sys_s": round(float(thread[1]), 3),
        "recv_faults": int(thread[2]),
    }
    if alone:
        out["probe_slowdown"] = round(1 - loops / elapsed / alone, 3)
    return out


def _check(r: int, pieces: list[Any], args: argparse.Namespace, layers: tuple[int, ...]) -> int:
    want = args.prompt + args.gen - 1
    assert pieces[-1].complete, f"request {r}: not complete"
    positions = torch.cat([p.positions for p in pieces])
    assert positions.tolist() == list(range(want)), f"request {r}: positions"
    assert (torch.cat([p.token_ids for p in pieces]) == positions + 7).all()
    for layer in layers:
        t = torch.cat([p.tensors[(layer, "post_block")] for p in pieces])
        assert t.shape == (want, args.hidden), (r, layer, t.shape)
        assert (t[:, 0] == positions.to(torch.bfloat16)).all(), (r, layer)
        assert (t[:, 1] == r).all() and (t[:, 2] == layer).all(), (r, layer)
    return want * len(layers)


def run_bus(args: argparse.Namespace) -> dict[str, Any]:
    """A bare ``block`` subscriber on a thread of this process, only receiving: the
    least any return path that receives in this process costs it."""
    from actbus.bus import Subscriber, Subscription
    from actbus.bus.subscriber import Batch

    n = len(_plan(args)) * args.taps
    proc = _start_publisher(args)
    sub = Subscriber(args.address, Subscription(policy="block", returned_only=True))
    sub.wait_welcome(30)
    got: list[int] = [0]

    def receive() -> None:
        while got[0] < n:
            out = sub.recv(timeout=30)
            if out is None:
                raise SystemExit(f"the bus subscriber got {got[0]} of {n} messages")
            got[0] += isinstance(out, Batch)

    probe = Probe() if args.probe else None
    alone = probe.rate(1.0) if probe else 0.0
    n0 = probe.count if probe else 0
    th = threading.Thread(target=receive, daemon=True)
    th.start()
    th0 = thread_cpu = _thread_cpu(th.native_id)
    _go(proc)
    t0, c0 = time.monotonic(), time.process_time()
    while th.is_alive():
        th.join(0.005)
        if th.is_alive():  # a finished thread's figures are gone from /proc
            thread_cpu = _thread_cpu(th.native_id)
    elapsed, cpu = time.monotonic() - t0, time.process_time() - c0
    loops = (probe.count - n0) if probe else 0
    if probe:
        probe.stop()
    sub.close()
    _finish(proc)
    return _figures(elapsed, cpu, thread_cpu - th0, alone, loops) | {"messages": got[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16, help="requests prefilled per step")
    ap.add_argument("--taps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--delta", action="store_true", help="a DELTA output every step")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {ARMS}, in order")
    ap.add_argument("--probe", action="store_true", help="a GIL probe thread (see above)")
    ap.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publisher:
        return publisher_main(args)
    args.address = f"ipc://{tempfile.mkdtemp(prefix='bench-ret-')}/bus.sock"
    out = {k: getattr(args, k) for k in ("requests", "prompt", "gen", "chunk", "taps", "hidden")}
    out["delta"] = args.delta
    arms = args.arms.split(",")
    if any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose from {ARMS}")
    results = {}
    for arm in arms:
        args.address = f"ipc://{tempfile.mkdtemp(prefix='bench-ret-')}/bus.sock"
        results[arm] = run_bus(args) if arm == "bus" else run_collector(args, arm)
    head = ("arm", "s", "cpu s", "recv user s", "recv sys s", "recv faults", "probe slowdown")
    print("\n{:10s} {:>7s} {:>7s} {:>12s} {:>11s} {:>12s} {:>12s}".format(*head))
    for arm, r in results.items():
        gil = f"{r['probe_slowdown']:.3f}" if "probe_slowdown" in r else ""
        print(
            f"{arm:10s} {r['s']:7.3f} {r['cpu_s']:7.3f} {r['recv_user_s']:12.3f} "
            f"{r['recv_sys_s']:11.3f} {r['recv_faults']:12,d} {gil:>12s}"
        )
        out |= {f"{arm}_{k}": v for k, v in r.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
