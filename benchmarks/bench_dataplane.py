"""The capture data path in pieces, for the all-layer workload, in one run (issue 48).

Lossless capture of every layer ran the engine at 0.40 of plain vLLM on an H200
(about 3 GB/s). This splits the path the rows take into pieces, each measured alone,
so the ceiling of each is known:

    d2h_*     the capture worker's own step (``CaptureWorker.on_step``: rows planned,
              gathered on the device, copied on its side stream into pinned host
              memory, torch's pinned cache) into an outlet that only waits for each
              copy to land and lets the memory go: the device-to-host copy alone
    shm_*     the same step into a real ``Publisher`` whose shared-memory ``Region``
              exists (as it does once a subscriber on this host joined) but which has
              no subscriber: the copy lands in the region (pinned with
              cudaHostRegister), is queued, waited for and let go by the publisher
              thread
    null_*    the same step into a real ``Publisher`` with one ``null`` subscriber on
              this host (its own process, ``block``: lossless), reading views of the
              region: the whole bus path, without an engine
    plain     vLLM without actbus, Llama-3-8B shape, dummy bf16 weights
    all_layers  the same engine capturing all 32 layers to one ``block`` null
              subscriber, as ``bench_capture.py``'s ``all_layers`` arm

The pieces without an engine (``d2h``, ``shm``, ``null``) run on synthetic tap
buffers of the engine's shape (32 layers x ``post_block``, hidden 4096, bf16) and
synthetic steps of two kinds: ``prefill`` (``--prefill-tokens`` tokens a step, fresh
requests of ``--prompt-len`` tokens each, ended in the next step) and ``decode``
(``--decode-tokens`` requests of one token each). Each runs the real
``CaptureWorker`` (its all-rows fast path, its staging in ``STAGE_BYTES`` chunks, its
side stream); nothing runs a forward between steps, so the engine thread issues
steps as fast as the path takes them, held back only by the queue's byte budget
(``--queue-mb``, as the engine arms' ``queue_mb``), as the engine is.

For each arm: GB/s of activation rows through it (``d2h``/``shm``: until the last
copy is waited for and let go; ``null``: until the subscriber acknowledged every
message; engine: rows captured while timed generation ran, over its time), and the
engine thread's time in actbus per step (``capture_s``, which includes ``stall_s``:
waiting for queue space), with the publisher's ``queued_bytes_peak``, ``unpinned``,
``pinned_host`` and the region's counters where they apply. Ratios: each piece
against ``d2h`` of the same step kind, ``all_layers`` against ``plain``, all in this
run. Every arm runs in its own process under ``--arm-timeout``; one that runs past
it is named in the JSON line (``timed_out_<arm>``) and the others go on.

    python benchmarks/bench_dataplane.py                  # a GPU: every arm
    python benchmarks/bench_dataplane.py --tiny           # CPU, small sizes (< 1 min)
    python benchmarks/bench_dataplane.py --configs d2h_prefill,shm_prefill,null_prefill

On CPU (``--tiny``) there is no device-to-host copy: ``d2h`` is the gather into
ordinary memory and ``shm``/``null`` gather straight into the region, as the worker
does on CPU; the engine arms use the tiny Llama.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_arms import (
    FAILED,
    RESULT,
    ArmFlags,
    CostMeter,
    Parallel,
    add_bench_args,
    all_counters,
    arm_argv,
    bus_template,
    make_llm,
    model,
    parse_bench_args,
    random_prompts,
    run_arms,
    shutdown,
    start_bus_subscriber,
    stop_bus_subscriber,
    timed_generate,
    wait_all_subscribed,
    wait_subscribed,
)

PIECES = ("d2h", "shm", "null")
KINDS = ("prefill", "decode")
ARMS = (*(f"{p}_{k}" for k in KINDS for p in PIECES), "plain", "all_layers")
SHAPE = {  # synthetic taps: the engine's, or --tiny's
    "gpu": {"layers": 32, "hidden": 4096, "dtype": "bfloat16", "device": "cuda"},
    "tiny": {"layers": 4, "hidden": 256, "dtype": "float32", "device": "cpu"},
}
STEP_SIZES = {  # tokens a step, prompt length, bytes of rows to move per arm
    "gpu": {"prefill_tokens": 8192, "decode_tokens": 512, "prompt_len": 256, "gib": 24.0},
    "tiny": {"prefill_tokens": 512, "decode_tokens": 32, "prompt_len": 64, "gib": 0.1},
}
WARM_STEPS = 3


# ------------------------------------------------------------------ synthetic steps
def _steps(kind: str, tokens: int, prompt_len: int, count: int, device: Any) -> list[Any]:
    """``count`` step views of ``kind``, as a runner lays them out: prefill steps of
    fresh requests of ``prompt_len`` tokens (the previous step's end in this one), or
    decode steps of ``tokens`` requests of one token each."""
    import numpy as np
    import torch

    from actbus.steps import StepRequests, StepView

    views, prev = [], []
    per = min(prompt_len, tokens) if kind == "prefill" else 1
    nreq = max(1, tokens // per)
    for s in range(count):
        if kind == "prefill":
            ids = [f"p{s}-{i}" for i in range(nreq)]
            starts = dict.fromkeys(ids, 0)
            new, finished, prev = ids, set(prev), ids
        else:
            ids = [f"d{i}" for i in range(nreq)]
            starts = dict.fromkeys(ids, prompt_len + s)
            new, finished = (ids if s == 0 else []), set()
        offsets = np.arange(nreq + 1, dtype=np.int64) * per
        pos = np.concatenate([np.arange(starts[r], starts[r] + per) for r in ids])
        wire = None  # filled by _admit_wire
        sr = StepRequests(
            new=[(r, prompt_len, wire) for r in new],
            starts=starts,
            finished=finished,
            reasons=dict.fromkeys(finished, "length"),
            scheduled=dict.fromkeys(ids, per),
            total=nreq * per,
        )
        views.append(
            StepView(
                req_ids=ids,
                offsets=offsets,
                positions=torch.from_numpy(pos).to(device),
                token_ids=torch.arange(nreq * per, device=device) % 32000,
                requests=sr,
            )
        )
    return views


def _with_selection(views: list[Any], layers: list[int]) -> None:
    """Every request asks for every layer, hook and position (the engine's all-layer
    lossless capture: the worker's fast path)."""
    wire = {"layers": layers, "hooks": ["post_block"], "positions": "all"}
    for v in views:
        v.requests.new = [(r, n, wire) for r, n, _ in v.requests.new]


# ---------------------------------------------------------------------- outlets
class CopyOnly:
    """An outlet (``actbus.bus.outlet.Outlet``) that takes every tap and only waits for
    each message's device copy, on its own thread as the publisher's does, then lets
    its memory go: what is left of the bus when the copy is all that runs. Its byte
    budget holds the engine thread back as the publisher's queue budget does."""

    def __init__(self, address: str, *, info: dict, queue_bytes: int = 1 << 30, **_: Any):
        self.address = address
        self._budget = queue_bytes
        self._queued = 0
        self._peak = 0
        self._q: deque = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.stall_s = 0.0
        self.capture_s = 0.0
        self.tokens = 0
        self.landed = 0
        self._thread = threading.Thread(target=self._run, name="copy-only", daemon=True)
        self._thread.start()

    def admit(self, step, taps):
        from actbus.bus.outlet import Admission

        return [Admission.SEND] * len(taps)

    def drop(self, header) -> None:
        pass

    def host_tensor(self, shape, dtype):
        return None  # torch's pinned cache, as with no region

    def publish(self, header, tensor, *, ready=None) -> None:
        n = header.nbytes
        with self._cond:
            t0 = None
            while self._q and self._queued + n > self._budget:
                t0 = t0 or time.monotonic()
                self._cond.wait(0.5)
            if t0 is not None:
                self.stall_s += time.monotonic() - t0
            self._q.append((tensor, ready, n))
            self._queued += n
            self._peak = max(self._peak, self._queued)
            self._cond.notify_all()

    def count_step(self, tokens: int, capture_s: float = 0.0) -> None:
        self.tokens += tokens
        self.capture_s += capture_s

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._closing:
                    self._cond.wait()
                if not self._q:
                    return
                tensor, ready, n = self._q[0]
            if ready is not None:
                ready.synchronize()
            del tensor
            with self._cond:
                self._q.popleft()
                self._queued -= n
                self.landed += n
                self._cond.notify_all()

    def drained(self) -> bool:
        with self._cond:
            return not self._q

    def stats(self) -> dict[str, Any]:
        from actbus.bus.publisher import _pinned_host

        return {
            "capture_s": self.capture_s,
            "stall_s": self.stall_s,
            "queued_bytes_peak": self._peak,
            "unpinned": 0,
            "pinned_host": _pinned_host(),
        }

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)


def _unsubscribed_publisher():
    """A real ``Publisher`` whose region is made at once, as a local subscriber's HELLO
    makes it, and which takes every tap though no one subscribed (``admit`` would
    say no copy is worth making)."""
    import torch

    from actbus.bus.outlet import Admission
    from actbus.bus.publisher import Publisher
    from actbus.bus.shm import Region

    class Unsubscribed(Publisher):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            pin = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._region = Region(self._shm_bytes, pin=pin)

        def admit(self, step, taps):
            return [Admission.SEND] * len(taps)

        def drained(self) -> bool:
            return not self._busy()

    return Unsubscribed


# ----------------------------------------------------------------- one piece arm
def run_piece(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One of d2h/shm/null for prefill or decode steps, in this process."""
    import torch

    import actbus.capture.worker as worker_mod
    from actbus.capture.taps import TapSet
    from actbus.config import CaptureConfig

    piece, kind = name.split("_")
    shape = SHAPE["tiny" if args.tiny else "gpu"]
    dtype = getattr(torch, shape["dtype"])
    device = torch.device(shape["device"])
    layers, hidden = shape["layers"], shape["hidden"]
    tokens = args.prefill_tokens if kind == "prefill" else args.decode_tokens
    step_bytes = tokens * layers * hidden * dtype.itemsize
    steps = max(4, int(args.gib * 2**30 // step_bytes))
    gen = torch.Generator(device=device).manual_seed(0)
    buffers = {
        (i, "post_block"): torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
        for i in range(layers)
    }
    taps = TapSet(buffers, hidden, dtype, tokens, device)
    address = f"ipc://{tempfile.mkdtemp(prefix='bench-plane-')}/bus.sock"
    cfg = CaptureConfig.from_dict(
        {"layers": "all", "publish": address, "queue_mb": args.queue_mb, "shm_mb": args.shm_mb}
    )
    outlet = {"d2h": CopyOnly, "shm": _unsubscribed_publisher()}.get(piece)
    if outlet is not None:  # the worker builds its outlet as it builds its Publisher
        worker_mod.Publisher = outlet
    worker = worker_mod.CaptureWorker(cfg, taps, "bench", layers=tuple(range(layers)))
    pub = worker.publisher
    sub = None
    if piece == "null":
        sub = start_bus_subscriber(address, "block")
        wait_subscribed(address, "null", timeout=args.arm_timeout / 2)
    views = _steps(kind, tokens, args.prompt_len, WARM_STEPS + steps, device)
    _with_selection(views, list(range(layers)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def drained() -> bool:
        if piece == "null":  # every message sent and acknowledged (what close waits for)
            return not pub._busy()
        return pub.drained()

    def drain(deadline: float) -> None:
        while not drained():
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: the outlet did not drain in time")
            time.sleep(0.0005)

    for v in views[:WARM_STEPS]:  # pinned cache, region pages, sockets: warmed
        v.started = time.perf_counter()
        worker.on_step(v)
    sync()
    drain(time.monotonic() + args.arm_timeout / 2)
    before = dict(pub.stats())
    t0 = time.monotonic()
    for v in views[WARM_STEPS:]:
        v.started = time.perf_counter()
        worker.on_step(v)
    issued = time.monotonic() - t0
    after = dict(pub.stats())  # the engine thread's counters, before the drain
    drain(t0 + args.arm_timeout / 2)
    wall = time.monotonic() - t0
    if worker.stopped:
        raise SystemExit(f"{name}: capture stopped: {worker.stopped}")
    moved = steps * step_bytes
    result: dict[str, Any] = {
        "arm": name,
        "piece": piece,
        "kind": kind,
        "tokens_per_step": tokens,
        "steps": steps,
        "step_mib": round(step_bytes / 2**20, 1),
        "gb_per_s": round(moved / wall / 1e9, 3),
        "tok_per_s": round(steps * tokens / wall, 1),
        "issue_s": round(issued, 3),
        "wall_s": round(wall, 3),
        "engine_ms_per_step": round(1e3 * (after["capture_s"] - before["capture_s"]) / steps, 3),
        "stall_ms_per_step": round(1e3 * (after["stall_s"] - before["stall_s"]) / steps, 3),
        "queued_mb_peak": round(after["queued_bytes_peak"] / 2**20, 1),
        "unpinned": int(after.get("unpinned", 0)) - int(before.get("unpinned", 0)),
        "pinned_host": after.get("pinned_host") or {},
    }
    if shm := after.get("shm"):
        result["shm"] = {k: shm[k] for k in ("bytes", "peak_bytes", "blocks", "full", "pinned")}
    pub.close()
    if sub is not None:
        got = stop_bus_subscriber(name, sub)
        want = (WARM_STEPS + steps) * layers * tokens
        if got.get("rows") != want:
            raise SystemExit(f"{name}: the subscriber got {got.get('rows')} rows, expected {want}")
        result["subscriber"] = {k: got.get(k) for k in ("messages", "rows", "bytes", "seconds")}
    return result


# ---------------------------------------------------------------- engine arms
def run_engine(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``plain`` or ``all_layers`` (bench_capture's lossless all-layer arm), with the
    publisher's counters over the timed generation."""
    from vllm import SamplingParams

    model_dir, config = model(args.tiny)
    par = Parallel.of(args)
    extra: dict[str, Any] = {}
    sub = None
    if name == "all_layers":
        address = bus_template(tempfile.mkdtemp(prefix="bench-plane-"), "bus", par)
        extra = {"actbus": {"publish": address, "layers": "all", "queue_mb": args.queue_mb}}
        sub = start_bus_subscriber(address, "block")
    t0 = time.monotonic()
    llm = make_llm(
        model_dir, tiny=args.tiny, input_len=args.input, output_len=args.output, extra=extra
    )
    start_s = time.monotonic() - t0
    if sub is not None:
        wait_all_subscribed(address, "null", par)
    prompts = random_prompts(args.prompts, args.input, config["vocab_size"])
    sp = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    from benchmarks.engine_arms import warm_up

    warm_up(llm, prompts)
    meter = before = None
    if sub is not None:
        before = all_counters([address])
        meter = CostMeter(address)
    _, timed = timed_generate(llm, prompts, sp)
    result: dict[str, Any] = {"arm": name, "engine_start_s": round(start_s, 1), **timed}
    if meter is not None:
        cost = meter.result()
        tokens = all_counters([address])["tokens"] - before["tokens"]
        row = config["num_hidden_layers"] * config["hidden_size"] * (4 if args.tiny else 2)
        result["cost"] = cost
        result["gb_per_s"] = round(tokens * row / timed["gen_s"] / 1e9, 3)
        result["engine_ms_per_step"] = cost["capture_ms_per_step"]
        result["stall_ms_per_step"] = round(1e3 * cost["stall_s"] / max(1, cost["steps"]), 3)
    shutdown(llm)
    if sub is not None:
        got = stop_bus_subscriber(name, sub)
        result["subscriber"] = {k: got.get(k) for k in ("messages", "rows", "bytes")}
        if dropped := got.get("dropped_by_publisher"):
            raise SystemExit(f"{name}: lossless, yet the publisher dropped {dropped}")
    return result


# ----------------------------------------------------------------------- table
def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPE["tiny" if args.tiny else "gpu"]
    print(
        f"\ntaps: {shape['layers']} layers x post_block, hidden {shape['hidden']}, "
        f"{shape['dtype']}, {shape['device']}; steps: prefill {args.prefill_tokens} tokens, "
        f"decode {args.decode_tokens}; queue {args.queue_mb} MiB, region {args.shm_mb:g} MiB"
    )
    head = f"{'arm':14s} {'GB/s':>8s} {'vs base':>8s} {'tok/s':>11s} {'engine ms/step':>15s}"
    print(head + f" {'stall ms/step':>14s} {'queue MiB':>10s}  notes")
    out: dict[str, Any] = {"arms": {}, "shape": shape}
    for name, r in results.items():
        if name in ("plain", "all_layers"):
            base = results.get("plain", {}).get("tok_per_s")
            ratio = r["tok_per_s"] / base if base else float("nan")
        else:
            base = results.get(f"d2h_{r['kind']}", {}).get("gb_per_s")
            ratio = r["gb_per_s"] / base if base else float("nan")
        notes = []
        if "shm" in r:
            shm = r["shm"]
            notes.append(f"region full {shm['full']}x, peak {shm['peak_bytes'] >> 20} MiB")
        if r.get("unpinned"):
            notes.append(f"unpinned {r['unpinned']}")
        if r.get("pinned_host", {}).get("num_host_alloc"):
            notes.append(f"pinned allocs {int(r['pinned_host']['num_host_alloc'])}")
        if "cost" in r:
            notes.append(f"queue peak {r['cost'].get('queued_mb_peak')} MiB")
        if name == "plain":
            notes.append("baseline")
        gb = r.get("gb_per_s", float("nan"))
        eng = r.get("engine_ms_per_step", float("nan"))
        stall = r.get("stall_ms_per_step", float("nan"))
        queue = r.get("queued_mb_peak", r.get("cost", {}).get("queued_mb_peak", float("nan")))
        print(
            f"{name:14s} {gb:>8.3f} {ratio:>8.3f} {r['tok_per_s']:>11.1f} {eng:>15.3f} "
            f"{stall:>14.3f} {queue:>10.1f}  {'; '.join(notes)}"
        )
        out["arms"][name] = {**r, "ratio": round(ratio, 4)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arms = ArmFlags(ARMS, arm_timeout=600.0)
    add_bench_args(ap, arms)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cpu: as --tiny")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="tokens a prefill step")
    ap.add_argument("--decode-tokens", type=int, default=None, help="tokens a decode step")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens a prefill request")
    ap.add_argument("--gib", type=float, default=None, help="GiB of rows each piece moves")
    ap.add_argument("--queue-mb", type=int, default=4096, help="the publisher's queue budget")
    ap.add_argument("--shm-mb", type=float, default=1024.0, help="the region (actbus.shm_mb)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default=None)
    if pre.parse_known_args()[0].device == "cpu" and "--tiny" not in sys.argv:
        sys.argv.append("--tiny")  # the CPU run is the tiny one
    args = parse_bench_args(ap, arms)
    for k, v in STEP_SIZES["tiny" if args.tiny else "gpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one:
        run = run_engine if args.one in ("plain", "all_layers") else run_piece
        print(RESULT + json.dumps(run(args.one, args)), flush=True)
        return 0
    argv = [*arm_argv(args), "--prefill-tokens", str(args.prefill_tokens)]
    argv += ["--decode-tokens", str(args.decode_tokens), "--prompt-len", str(args.prompt_len)]
    argv += ["--gib", str(args.gib), "--queue-mb", str(args.queue_mb)]
    argv += ["--shm-mb", str(args.shm_mb), "--arm-timeout", str(args.arm_timeout)]
    plugins = lambda name: "no-plugin" if name == "plain" else "actbus"  # noqa: E731
    results = run_arms(__file__, args.arms, argv, plugins, args.arm_timeout)
    summary = summarize(results, args)
    summary.update(FAILED)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
