"""Generation throughput with actbus steering vs plain vLLM, in one run (GPU).

Llama-3-8B shape with dummy weights (``engine_arms.LLAMA3_8B``), PROMPTS prompts of
INPUT random token ids, OUTPUT new tokens each, vLLM's defaults (torch.compile, CUDA
graphs). Each configuration runs in its own process (a fresh engine):

    plain              actbus not loaded
    steer_1            every request steered at layer 16 (a named vector)
    steer_4            every request steered at layers 4, 12, 20, 28, norm-matched
    steer_mixed        half the requests steered at layer 16, each with its own vector
    steer_and_capture  steer_1 plus layers 4, 12, 20, 28 captured to a lossless
                       (``block``) null subscriber
    lens_steer_1       vllm-lens 1.2.1 (a peer plugin; it forces eager mode) steering
                       every request at layer 16 with the same vector and scale

Each arm loads only its own plugin (``VLLM_PLUGINS``), so an installed vllm-lens never
forces eager mode on the actbus arms. ``--tp``, ``--pp`` and ``--dp`` set every arm's
parallelism alike (``engine_arms.add_parallel_args``).

Prints a table, then one JSON line with every figure and ``ratio_<config>`` (tokens per
second against ``plain``).

    python benchmarks/bench_steer.py [--prompts 512 --input 256 --output 256]
    python benchmarks/bench_steer.py --tiny      # a CPU check with the tiny Llama
    python benchmarks/bench_steer.py --tp 2 --dp 2   # every arm on 4 GPUs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass

from engine_arms import (
    FAILED,
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
    wait_all_subscribed,
    warm_up,
)

CAPTURED = [4, 12, 20, 28]
TINY_LAYERS = {16: 2, 4: 0, 12: 1, 20: 2, 28: 3}  # the tiny Llama has 4 layers


@dataclass(frozen=True)
class Arm:
    layers: list[int]  # steerable and steered
    norm_match: bool = False
    share: float = 1.0  # of the requests steered; below 1: each its own vector
    capture: bool = False


CONFIGS: dict[str, Arm | None] = {
    "plain": None,
    "steer_1": Arm([16]),
    "steer_4": Arm(CAPTURED, norm_match=True),
    "steer_mixed": Arm([16], share=0.5),
    "steer_and_capture": Arm([16], capture=True),
    "lens_steer_1": None,  # vllm-lens, not actbus: see run_one
}
PLUGINS = {"plain": "no-plugin", "lens_steer_1": "activations"}  # else "actbus"


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration, in this process: start the engine, generate, time it."""
    import torch
    from vllm import SamplingParams

    path, config = model(args.tiny)
    par = Parallel.of(args)
    hidden = config["hidden_size"]
    arm = CONFIGS[name]
    layers = (lambda ls: [TINY_LAYERS[x] for x in ls]) if args.tiny else (lambda ls: ls)
    extra: dict = {}
    subs = []
    address = bus_template(tempfile.mkdtemp(), "bus", par)
    if arm is not None:
        # Capture of the steered configurations is restricted to no request but the
        # capture arm's (requests: selected), so only steering is measured.
        extra = {
            "actbus": {
                "publish": address,
                "layers": layers(CAPTURED),
                "requests": "all" if arm.capture else "selected",
                "queue_mb": 4096,
                "steer": {"layers": layers(arm.layers), "hooks": ["post_block"]},
            }
        }
        if arm.capture:
            subs = start_bus_subscribers(address, "block", par)
    t0 = time.monotonic()
    llm = make_llm(
        path,
        tiny=args.tiny,
        input_len=args.input,
        output_len=args.output,
        extra=extra,
        parallel=par,
    )
    start_s = time.monotonic() - t0
    if subs:
        wait_all_subscribed(address, "null", par)
    prompts = random_prompts(args.prompts, args.input, config["vocab_size"])
    base = dict(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    params = [SamplingParams(**base) for _ in prompts]  # plain
    g = torch.Generator().manual_seed(0)
    if name.startswith("lens_"):
        from vllm_lens import SteeringVector

        v = torch.randn(hidden, generator=g)
        sv = SteeringVector(activations=v[None], layer_indices=layers([16]), scale=0.5)
        params = [
            SamplingParams(**base, extra_args={"apply_steering_vectors": [sv]}) for _ in prompts
        ]
    if arm is not None:
        from actbus.engine.api import vectors

        own = arm.share < 1.0
        every = round(1 / arm.share)
        for i in range(len(prompts) if own else 1):
            vectors(llm).register(f"v{i}", torch.randn(hidden, generator=g))
        params = []
        for i in range(len(prompts)):
            entry = {"vector": f"v{i if own else 0}", "layers": layers(arm.layers), "scale": 0.5}
            if arm.norm_match:
                entry["norm_match"] = True
            steer = {"actbus": {"steer": [entry]}} if i % every == 0 else None
            params.append(SamplingParams(**base, extra_args=steer))
    warm_up(llm, prompts)
    _, timed = timed_generate(llm, prompts, params)
    result = {
        "config": name,
        "engine_start_s": round(start_s, 1),
        **timed,
    }
    shutdown(llm)
    if subs:
        result["subscriber"] = stop_bus_subscribers(name, subs)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arms = ArmFlags(
        tuple(CONFIGS), default=tuple(c for c in CONFIGS if not c.startswith("lens_"))
    )  # lens_steer_1 needs vllm-lens installed
    add_bench_args(ap, arms)
    args = parse_bench_args(ap, arms)
    if args.one:
        print(RESULT + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    plugins = lambda name: PLUGINS.get(name, "actbus")  # noqa: E731
    results = run_arms(__file__, args.arms, arm_argv(args), plugins, args.arm_timeout)
    summary = throughput_table(results, args, width=18)
    for name, r in results.items():
        if r.get("subscriber"):
            summary[f"received_msgs_{name}"] = r["subscriber"].get("messages", 0)
            if ranks := r["subscriber"].get("per_rank"):
                summary[f"received_msgs_by_rank_{name}"] = [x["messages"] for x in ranks]
    summary.update(FAILED)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
