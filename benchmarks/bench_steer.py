"""Generation throughput with actbus steering vs plain vLLM, in one run (GPU).

Llama-3-8B shape with dummy weights (``bench_capture.LLAMA3_8B``), PROMPTS prompts of
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
forces eager mode on the actbus arms.

Prints a table, then one JSON line with every figure and ``ratio_<config>`` (tokens per
second against ``plain``).

    python benchmarks/bench_steer.py [--prompts 512 --input 256 --output 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine_arms import LLAMA3_8B

from actbus.cli import consumer_command

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = [4, 12, 20, 28]


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
    import random

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = Path(tempfile.mkdtemp(prefix="bench-8b-"))
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    arm = CONFIGS[name]
    lens = name.startswith("lens_")
    extra: dict = {}
    sub = None
    if arm is not None:
        address = f"ipc://{tempfile.mkdtemp()}/bus.sock"
        # Capture of the steered configurations is restricted to no request but the
        # capture arm's (requests: selected), so only steering is measured.
        extra = {
            "actbus": {
                "publish": address,
                "layers": CAPTURED,
                "requests": "all" if arm.capture else "selected",
                "queue_mb": 4096,
                "steer": {"layers": arm.layers, "hooks": ["post_block"]},
            }
        }
        if arm.capture:
            sub = subprocess.Popen(
                consumer_command("null", address, "--policy", "block", "--log-level", "WARNING"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
    t0 = time.monotonic()
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.input + args.output + 8,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        seed=0,
        additional_config=extra,
    )
    start_s = time.monotonic() - t0
    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(1000, 120000) for _ in range(args.input)])
        for _ in range(args.prompts)
    ]
    base = dict(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    params = [SamplingParams(**base) for _ in prompts]  # plain
    if lens:
        from vllm_lens import SteeringVector

        v = torch.randn(LLAMA3_8B["hidden_size"], generator=torch.Generator().manual_seed(0))
        sv = SteeringVector(activations=v[None], layer_indices=[16], scale=0.5)
        params = [
            SamplingParams(**base, extra_args={"apply_steering_vectors": [sv]}) for _ in prompts
        ]
    if arm is not None:
        from actbus.steer.api import vectors

        g = torch.Generator().manual_seed(0)
        own = arm.share < 1.0
        every = round(1 / arm.share)
        for i in range(len(prompts) if own else 1):
            vectors(llm).register(f"v{i}", torch.randn(LLAMA3_8B["hidden_size"], generator=g))
        params = []
        for i in range(len(prompts)):
            entry = {"vector": f"v{i if own else 0}", "layers": arm.layers, "scale": 0.5}
            if arm.norm_match:
                entry["norm_match"] = True
            steer = {"actbus": {"steer": [entry]}} if i % every == 0 else None
            params.append(SamplingParams(**base, extra_args=steer))
    llm.generate(
        prompts[:16],
        SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )  # warm-up
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.monotonic() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "config": name,
        "engine_start_s": round(start_s, 1),
        "gen_s": round(gen_s, 2),
        "generated_tokens": generated,
        "tok_per_s": round(generated / gen_s, 1),
    }
    llm.llm_engine.engine_core.shutdown()
    if sub is not None:
        time.sleep(2.0)
        sub.terminate()
        out, err = sub.communicate(timeout=30)
        stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        if not stats.get("messages"):  # a run without its subscriber measures nothing
            raise SystemExit(f"{name}: the subscriber received nothing:\n{err[-3000:]}")
        result["subscriber"] = stats
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument(
        "--configs",
        default=",".join(c for c in CONFIGS if not c.startswith("lens_")),
        help="comma-separated arms; lens_steer_1 needs vllm-lens installed",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    results = {}
    for name in args.configs.split(","):
        env = {**os.environ, "VLLM_PLUGINS": PLUGINS.get(name, "actbus")}
        cmd = [sys.executable, __file__, "--one", name, "--prompts", str(args.prompts),
               "--input", str(args.input), "--output", str(args.output)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"configuration {name} failed")
        results[name] = json.loads(line[-1][len("RESULT ") :])
        print(f"  {name:18s} {results[name]['tok_per_s']:>10.1f} tok/s", flush=True)
    base = results.get("plain", {}).get("tok_per_s")
    print(f"\n{'config':18s} {'tok/s':>10s} {'vs plain':>9s} {'start s':>8s}")
    summary: dict = {}
    for name, r in results.items():
        ratio = r["tok_per_s"] / base if base else float("nan")
        print(f"{name:18s} {r['tok_per_s']:>10.1f} {ratio:>9.3f} {r['engine_start_s']:>8.1f}")
        summary[f"tok_per_s_{name}"] = r["tok_per_s"]
        if name != "plain":
            summary[f"ratio_{name}"] = round(ratio, 4)
        if r.get("subscriber"):
            summary[f"received_msgs_{name}"] = r["subscriber"].get("messages", 0)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
