"""Generation throughput with actbus capture vs plain vLLM, in one run (GPU).

Llama-3-8B shape with dummy weights, PROMPTS prompts of INPUT random token ids,
OUTPUT new tokens each. Each configuration runs in its own process (a fresh
engine), with vLLM's defaults (torch.compile, CUDA graphs):

    plain        actbus not loaded (VLLM_PLUGINS names no plugin)
    none         actbus loaded, no capture configured
    1_layer      layer 16, all tokens, to a `null` subscriber that keeps up (block)
    4_layers     layers 4, 12, 20, 28, same subscriber
    all_layers_drop  all 32 layers, subscriber with drop_newest (drops counted)

Prints a table, then one JSON line with every figure and ratio.

    python benchmarks/bench_capture.py [--prompts 512 --input 256 --output 256]
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
    make_llm,
    model,
    random_prompts,
    run_arms,
    start_bus_subscriber,
    stop_bus_subscriber,
    timed_generate,
    warm_up,
)

__all__ = ["LLAMA3_8B"]  # bench_journey takes the model shape from here
CONFIGS = {
    "plain": None,
    "none": None,
    "1_layer": ([16], "block"),
    "4_layers": ([4, 12, 20, 28], "block"),
    "all_layers_drop": ("all", "drop_newest"),
}


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration, in this process: start the engine, generate, time it."""
    model_dir, config = model(tiny=False)
    extra: dict = {}
    sub = None
    if CONFIGS[name] is not None:
        layers, policy = CONFIGS[name]
        address = f"ipc://{tempfile.mkdtemp()}/bus.sock"
        extra = {"actbus": {"publish": address, "layers": layers, "queue_mb": 4096}}
        sub = start_bus_subscriber(address, policy)
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = make_llm(model_dir, tiny=False, input_len=args.input, output_len=args.output, extra=extra)
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
    llm.llm_engine.engine_core.shutdown()
    if sub is not None:
        result["subscriber"] = stop_bus_subscriber(name, sub)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(RESULT + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    argv = ["--prompts", str(args.prompts), "--input", str(args.input)]
    argv += ["--output", str(args.output)]
    results = run_arms(
        __file__,
        args.configs.split(","),
        argv,
        # plain: no plugin at all; the others actbus alone, so an installed peer plugin
        # (vllm-lens forces enforce_eager) cannot change how they run
        lambda name: "no-plugin" if name == "plain" else "actbus",
    )
    base = results.get("plain", {}).get("tok_per_s")
    print(f"\n{'config':16s} {'tok/s':>10s} {'vs plain':>9s} {'start s':>8s}  subscriber")
    summary: dict = {}
    for name, r in results.items():
        ratio = r["tok_per_s"] / base if base else float("nan")
        s = r.get("subscriber", {})
        sub_txt = (
            (
                f"{s.get('messages', 0)} msgs, {s.get('bytes', 0) / 2**30:.1f} GiB, "
                f"dropped {s.get('dropped_by_publisher', {})}"
            )
            if s
            else ""
        )
        tps, start = r["tok_per_s"], r["engine_start_s"]
        print(f"{name:16s} {tps:>10.1f} {ratio:>9.3f} {start:>8.1f}  {sub_txt}")
        summary[f"tok_per_s_{name}"] = r["tok_per_s"]
        if name != "plain":
            summary[f"ratio_{name}"] = round(ratio, 4)
        if s:
            summary[f"dropped_{name}"] = sum(s.get("dropped_by_publisher", {}).values())
            summary[f"received_msgs_{name}"] = s.get("messages", 0)
    summary.update(FAILED)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
