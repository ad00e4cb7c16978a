"""Activations returned to the caller (``"return": true``) against plain vLLM and the
bus, in one run (GPU).

Llama-3-8B shape with dummy bf16 weights, PROMPTS prompts of INPUT random token ids,
OUTPUT new tokens each, offline ``LLM``; every arm in its own process (a fresh
engine) with vLLM's defaults (torch.compile, CUDA graphs):

    plain      actbus not loaded (VLLM_PLUGINS names no plugin)
    return_1   layer 16 tapped; every request asks ``"return": true`` (every position)
    return_4   layers 4, 12, 20, 28; the same
    bus_4      layers 4, 12, 20, 28 to a lossless (``block``) ``null`` subscriber in
               another process, as bench_capture.py's 4_layers; nothing returned

The rows are counted. A return arm checks, per request and tapped layer, that its
output carries prompt + generated - 1 rows, at positions 0.., marked ``complete``;
the bus arm, that its subscriber got that many per layer for every request served
(the warm-up's included). A count that differs fails the run, naming the arm.

``--tp``, ``--pp`` and ``--dp`` set every arm's parallelism alike
(``engine_arms.add_parallel_args``). Under data parallelism the prompts are spread
over the ranks round-robin, each rank publishes on its own address, and the bus arm
has one subscriber per rank: each must get the rows of the requests its rank served.

Prints a table, then one JSON line with every figure and ratio (``ratio_return_1``,
``ratio_return_4``, ``ratio_bus_4``: generated tok/s against plain) and the
parallelism (``tp``, ``pp``, ``dp``).

    python benchmarks/bench_return.py [--prompts 256 --input 256 --output 256]
    python benchmarks/bench_return.py --tiny     # CPU check: the tiny Llama
    python benchmarks/bench_return.py --dp 2     # every arm over two engine cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
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
    arm_argv,
    bus_template,
    cost_line,
    make_llm,
    model,
    parse_bench_args,
    random_prompts,
    rank_of,
    run_arms,
    shutdown,
    start_bus_subscribers,
    stop_bus_subscribers,
    throughput_table,
    timed_generate,
    wait_all_subscribed,
    warm_up,
)

ARMS = {
    # arm: (layers tapped, how the rows leave); None: plain vLLM
    "plain": None,
    "return_1": ("one", "return"),
    "return_4": ("four", "return"),
    "bus_4": ("four", "bus"),
}
LAYERS = {
    "gpu": {"one": [16], "four": [4, 12, 20, 28]},
    "tiny": {"one": [3], "four": [0, 1, 2, 3]},
}


def run_arm(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One arm, in this process: the engine, the timed generation, the row count."""
    from vllm import SamplingParams

    model_dir, config = model(args.tiny)
    par = Parallel.of(args)
    extra: dict[str, Any] = {}
    subs = []
    returns = None
    layers: list[int] = []
    if ARMS[name] is not None:
        which, how = ARMS[name]
        layers = LAYERS["tiny" if args.tiny else "gpu"][which]
        address = bus_template(tempfile.mkdtemp(prefix="bench-ret-"), "bus", par)
        extra = {"actbus": {"publish": address, "layers": layers, "queue_mb": 4096}}
        if how == "bus":
            subs = start_bus_subscribers(address, "block", par)
        else:
            returns = {"actbus": {"return": True}}  # the engine's layers, every position
    t0 = time.monotonic()
    llm = make_llm(
        model_dir,
        tiny=args.tiny,
        input_len=args.input,
        output_len=args.output,
        extra=extra,
        parallel=par,
    )
    start_s = time.monotonic() - t0
    if subs:  # so they count every row, the warm-up's too
        wait_all_subscribed(address, "null", par)
    prompts = random_prompts(args.prompts, args.input, config["vocab_size"])
    # The warm-up asks for rows too: the front end's return subscriber starts there.
    warm = warm_up(llm, prompts, returns)
    sp = SamplingParams(
        temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False,
        extra_args=returns,
    )  # fmt: skip
    meter = CostMeter(par.addresses(address)) if layers else None
    outs, timed = timed_generate(llm, prompts, sp)
    result: dict[str, Any] = {
        "arm": name,
        "layers": layers,
        "engine_start_s": round(start_s, 1),
        **timed,
    }
    if meter is not None:  # where the arm's cost lies: engine thread, front end
        result["cost"] = meter.result()
    shutdown(llm)
    if returns is not None:
        result |= _count_returned(name, outs, layers)
    if subs:
        stats = stop_bus_subscribers(name, subs)
        ranks = stats.get("per_rank", [stats])
        want = [0] * len(ranks)  # rows each rank's subscriber must have got
        for o in [*warm, *outs]:
            want[rank_of(llm, o)] += len(layers) * _fed(o)
        got = [r["rows"] for r in ranks]
        if got != want:
            raise SystemExit(f"{name}: the subscribers got {got} rows by dp rank, expected {want}")
        result |= {"rows": stats["rows"], "rows_expected": sum(want), "subscriber": stats}
        if len(ranks) > 1:
            result["rows_by_rank"] = got
    return result


def _fed(out: Any) -> int:
    """Positions fed for one output: prompt + generated - 1."""
    return len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1


def _count_returned(name: str, outs: list[Any], layers: list[int]) -> dict[str, Any]:
    """Every request's returned rows: prompt + generated - 1 per layer, in order."""
    rows = want = 0
    for o in outs:
        acts = getattr(o.outputs[0], "activations", None)
        n = _fed(o)
        if acts is None or not acts.complete:
            raise SystemExit(f"{name}: request {o.request_id} returned no complete activations")
        if acts.positions.tolist() != list(range(n)):
            raise SystemExit(f"{name}: request {o.request_id}: positions are not 0..{n - 1}")
        got = {layer: int(acts[(layer, "post_block")].shape[0]) for layer in layers}
        if any(g != n for g in got.values()):
            raise SystemExit(f"{name}: request {o.request_id}: rows {got}, expected {n} each")
        rows += sum(got.values())
        want += n * len(layers)
    return {"rows": rows, "rows_expected": want}


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    base = results.get("plain", {}).get("tok_per_s")
    s: dict[str, Any] = {
        "model": "tiny-llama" if args.tiny else "llama-3-8b-shape-dummy-bf16",
        **Parallel.of(args).summary(),
        "prompts": args.prompts,
        "input": args.input,
        "output": args.output,
    }
    for name, r in results.items():
        s[f"tok_per_s_{name}"] = r["tok_per_s"]
        s[f"gen_s_{name}"] = r["gen_s"]
        s[f"engine_start_s_{name}"] = r["engine_start_s"]
        if name != "plain":
            s[f"ratio_{name}"] = round(r["tok_per_s"] / base, 4) if base else None
            s[f"layers_{name}"] = r["layers"]
            s[f"rows_{name}"] = r["rows"]
            s[f"rows_expected_{name}"] = r["rows_expected"]
            s[f"rows_ok_{name}"] = r["rows"] == r["rows_expected"]
            if "rows_by_rank" in r:
                s[f"rows_by_rank_{name}"] = r["rows_by_rank"]
        for k, v in r.get("cost", {}).items():
            if k != "steps":
                s[f"{k}_{name}"] = v
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arms = ArmFlags(tuple(ARMS), flag="--arms", arm_timeout=1200.0, gpu_prompts=256)
    add_bench_args(ap, arms)
    args = parse_bench_args(ap, arms)
    if args.one:
        print(RESULT + json.dumps(run_arm(args.one, args)), flush=True)
        return 0
    plugins = lambda name: "no-plugin" if ARMS[name] is None else "actbus"  # noqa: E731
    results = run_arms(__file__, args.arms, arm_argv(args), plugins, args.arm_timeout)
    throughput_table(results, args, width=10)
    for name, r in results.items():
        if "rows" in r:
            check = "ok: prompt + generated - 1 per request per layer"
            if "rows_by_rank" in r:
                check += f"; by dp rank {r['rows_by_rank']}"
            layers = ",".join(map(str, r["layers"]))
            print(f"{name:10s} layers {layers}: {r['rows']:,} rows, {check}")
        if c := r.get("cost"):
            print(f"{name:10s} {cost_line(c)}")
    print(json.dumps({**summarize(results, args), **FAILED}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
