"""Generation throughput with actbus capture vs plain vLLM, in one run (GPU).

Llama-3-8B shape with dummy weights, PROMPTS prompts of INPUT random token ids,
OUTPUT new tokens each. Each configuration runs in its own process (a fresh
engine), with vLLM's defaults (torch.compile, CUDA graphs):

    plain        actbus not loaded (VLLM_PLUGINS names no plugin)
    none         actbus loaded, no capture configured
    1_layer      layer 16, all tokens, to a `null` subscriber that keeps up (block)
    4_layers     layers 4, 12, 20, 28, same subscriber
    4_layers_x3  the same layers to three such subscribers (fan-out)
    all_layers   all 32 layers to one block subscriber: lossless, every row delivered
    all_layers_drop  all 32 layers, subscriber with drop_newest (drops counted)

Subscribers run on the engine's host, so they read rows from its shared memory
(``ACTBUS_SHM=0`` in the environment: from the socket, for comparison).

Prints a table, then one JSON line with every figure and ratio. ``--tp``, ``--pp``
and ``--dp`` set every arm's parallelism alike (``engine_arms.add_parallel_args``);
under data parallelism each rank publishes on its own address and gets its own
subscriber.

    python benchmarks/bench_capture.py [--prompts 512 --input 256 --output 256]
    python benchmarks/bench_capture.py --tp 2          # every arm at tensor parallel 2
    python benchmarks/bench_capture.py --tiny      # a CPU check with the tiny Llama

``--moe``: the Qwen3-30B-A3B shape (48 layers, 128 experts, top 8; dummy bf16 weights;
``--tiny``: the tiny Qwen3-MoE) and its arms: plain, none, 1_layer (layer 24),
4_layers (6, 18, 30, 42) and router_all (the ``router`` hook on every layer).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_arms import (
    FAILED,
    LLAMA3_8B,
    RESULT,
    ArmFlags,
    Parallel,
    add_bench_args,
    arm_argv,
    bus_template,
    make_llm,
    model,
    parse_bench_args,
    random_prompts,
    run_arms,
    shutdown,
    start_bus_subscribers,
    stop_bus_subscribers,
    throughput_table,
    timed_generate,
    warm_up,
)

__all__ = ["LLAMA3_8B"]  # bench_journey takes the model shape from here
CONFIGS = {  # layers, policy, subscribers
    "plain": None,
    "none": None,
    "1_layer": ([16], "block", 1),
    "4_layers": ([4, 12, 20, 28], "block", 1),
    "4_layers_x3": ([4, 12, 20, 28], "block", 3),
    "all_layers": ("all", "block", 1),
    "all_layers_drop": ("all", "drop_newest", 1),
}
TINY_LAYERS = {16: 2, 4: 0, 12: 1, 20: 2, 28: 3}  # the tiny Llama has 4 layers
MOE_CONFIGS = {  # name -> (layers, policy, hooks)
    "plain": None,
    "none": None,
    "1_layer": ([24], "block", None),
    "4_layers": ([6, 18, 30, 42], "block", None),
    "router_all": ("all", "block", ["router"]),
}
MOE_TINY_LAYERS = {24: 2, 6: 0, 18: 1, 30: 2, 42: 3}  # the tiny Qwen3-MoE has 4 layers


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration, in this process: start the engine, generate, time it."""
    model_dir, config = model(args.tiny, args.moe)
    par = Parallel.of(args)
    extra: dict = {}
    subs = []
    arm = (MOE_CONFIGS if args.moe else CONFIGS)[name]
    if arm is not None:
        # CONFIGS: (layers, policy, subscribers); MOE_CONFIGS: (layers, policy, hooks)
        layers, policy, hooks, count = (*arm, 1) if args.moe else (*arm[:2], None, arm[2])
        tiny_map = MOE_TINY_LAYERS if args.moe else TINY_LAYERS
        if args.tiny and layers != "all":
            layers = [tiny_map[x] for x in layers]
        address = bus_template(tempfile.mkdtemp(), "bus", par)
        extra = {"actbus": {"publish": address, "layers": layers, "queue_mb": 4096}}
        if hooks:
            extra["actbus"]["hooks"] = hooks
        for _ in range(count):  # counters summed over them (and over dp ranks)
            subs += start_bus_subscribers(address, policy, par, ",".join(hooks or []))
    from vllm import SamplingParams

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
    prompts = random_prompts(args.prompts, args.input, config["vocab_size"])
    sp = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    warm_up(llm, prompts)
    _, timed = timed_generate(llm, prompts, sp)
    result = {
        "config": name,
        "engine_start_s": round(start_s, 1),
        **timed,
    }
    shutdown(llm)
    if subs:
        result["subscriber"] = stop_bus_subscribers(name, subs)
    return result


def per_rank(s: dict) -> str:
    """Each data-parallel rank's subscriber's messages, for the table."""
    ranks = s.get("per_rank")
    return f" (by dp rank: {[r.get('messages', 0) for r in ranks]} msgs)" if ranks else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    moe = "--moe" in sys.argv
    arms = ArmFlags(tuple(MOE_CONFIGS if moe else CONFIGS))
    add_bench_args(ap, arms)
    ap.add_argument("--moe", action="store_true", help="the Qwen3-30B-A3B shape and its arms")
    args = parse_bench_args(ap, arms)
    if args.one:
        print(RESULT + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    argv = arm_argv(args) + (["--moe"] if args.moe else [])
    # plain: no plugin at all; the others actbus alone, so an installed peer plugin
    # (vllm-lens forces enforce_eager) cannot change how they run
    plugins = lambda name: "no-plugin" if name == "plain" else "actbus"  # noqa: E731
    results = run_arms(__file__, args.arms, argv, plugins, args.arm_timeout)
    summary = throughput_table(results, args)
    for name, r in results.items():
        if s := r.get("subscriber", {}):
            print(
                f"{name:16s} subscriber: {s.get('messages', 0)} msgs, "
                f"{s.get('bytes', 0) / 2**30:.1f} GiB, "
                f"dropped {s.get('dropped_by_publisher', {})}" + per_rank(s)
            )
            summary[f"dropped_{name}"] = sum(s.get("dropped_by_publisher", {}).values())
            summary[f"received_msgs_{name}"] = s.get("messages", 0)
            if s.get("per_rank"):
                summary[f"received_msgs_by_rank_{name}"] = [x["messages"] for x in s["per_rank"]]
    summary.update(FAILED)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
