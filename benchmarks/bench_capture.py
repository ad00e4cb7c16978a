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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actbus.cli import consumer_command

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
CONFIGS = {
    "plain": None,
    "none": None,
    "1_layer": ([16], "block"),
    "4_layers": ([4, 12, 20, 28], "block"),
    "all_layers_drop": ("all", "drop_newest"),
}


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration, in this process: start the engine, generate, time it."""
    model_dir = Path(tempfile.mkdtemp(prefix="bench-8b-"))
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    extra: dict = {}
    sub = None
    if CONFIGS[name] is not None:
        layers, policy = CONFIGS[name]
        address = f"ipc://{tempfile.mkdtemp()}/bus.sock"
        extra = {"actbus": {"publish": address, "layers": layers, "queue_mb": 4096}}
        sub = subprocess.Popen(
            consumer_command("null", address, "--policy", policy, "--log-level", "WARNING"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
    sp = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    llm.generate(
        prompts[:16],
        SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )  # warm-up
    t0 = time.monotonic()
    outs = llm.generate(prompts, sp, use_tqdm=False)
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
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    results = {}
    for name in args.configs.split(","):
        env = dict(os.environ)
        if name == "plain":
            env["VLLM_PLUGINS"] = "no-plugin"  # load no general plugin at all
        cmd = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--prompts",
            str(args.prompts),
            "--input",
            str(args.input),
            "--output",
            str(args.output),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"configuration {name} failed")
        results[name] = json.loads(line[-1][len("RESULT ") :])
        print(f"  {name:16s} {results[name]['tok_per_s']:>10.1f} tok/s", flush=True)
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
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
