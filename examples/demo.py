"""`make demo`: serve a tiny model with actbus, sink its residual stream to disk.

1. builds (or reuses) a tiny random-weight Llama with a locally trained tokenizer;
2. starts `actbus run fs-sink` as its own process;
3. starts vLLM with the actbus publisher on layers 1 and 3 and generates text for
   a few dozen prompts;
4. prints where the activations landed and how many rows per layer, and checks
   one request against HF transformers' forward pass on the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actbus.cli import consumer_command
from actbus.streams import point_key

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 3]
TOPICS = [
    "the residual stream",
    "sparse autoencoders",
    "linear probes",
    "continuous batching",
    "chunked prefill",
    "prefix caching",
    "CUDA graphs",
    "ZeroMQ sockets",
    "Arrow files",
    "quick brown foxes",
    "lazy dogs",
    "throughput and latency",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "out" / "demo-run"), help="run directory")
    ap.add_argument("--prompts", type=int, default=36)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    from actbus.tiny_models import build_tiny_model

    print("[1/4] tiny model ...", flush=True)
    model = build_tiny_model("llama")
    print(f"      {model}")

    out = Path(args.out)
    if (out / "manifest.json").exists():
        import shutil

        shutil.rmtree(out)  # a demo run starts clean; real runs append instead
    address = f"ipc://{tempfile.mkdtemp(prefix='actbus-demo-')}/bus.sock"
    print(f"[2/4] fs-sink subscriber -> {out}", flush=True)
    sink = subprocess.Popen(
        consumer_command(
            "fs-sink", address, "--out", str(out), "--flush-s", "1", "--log-level", "WARNING"
        ),
        cwd=ROOT,
    )
    try:
        return _serve_and_report(model, address, out, sink, args)
    finally:
        if sink.poll() is None:
            sink.send_signal(signal.SIGTERM)
            sink.wait(timeout=30)


def _serve_and_report(model: Path, address: str, out: Path, sink, args) -> int:
    from vllm import LLM, SamplingParams

    print(
        f"[3/4] vLLM + actbus publisher on {address}, layers {LAYERS} "
        "(engine start with torch.compile takes about a minute on CPU)",
        flush=True,
    )
    t0 = time.monotonic()
    llm = LLM(
        str(model),
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_batched_tokens=128,
        seed=0,
        additional_config={"actbus": {"publish": address, "layers": LAYERS}},
    )
    print(f"      engine ready in {time.monotonic() - t0:.0f}s", flush=True)
    prompts = [
        f"{i}: a short note on {TOPICS[i % len(TOPICS)]}, " * (1 + i % 4)
        for i in range(args.prompts)
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=args.max_tokens))
    expected = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)

    print("[4/4] waiting for the sink to commit every row ...", flush=True)
    from tqdm import tqdm

    from consumers.fs import ActivationRun

    key = f"{LAYERS[-1]}/post_block"
    with tqdm(total=expected, unit="row", desc="rows on disk (last layer)") as bar:
        deadline = time.monotonic() + 120
        done = 0
        while done < expected and time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                done = ActivationRun(out).manifest["rows"].get(key, 0)
            bar.update(done - bar.n)
            time.sleep(0.2)
    sink.send_signal(signal.SIGTERM)
    sink.wait(timeout=30)
    llm.llm_engine.engine_core.shutdown()

    run = ActivationRun(out)
    m = run.manifest
    print(f"\nActivations of {len(outs)} requests landed in {out}")
    print(f"  model {m['model']}, hidden size {m['hidden_size']}, dtype {m['dtype']}")
    for layer in LAYERS:
        n_shards = len(run.shards(layer, "post_block"))
        rows = m["rows"][point_key(layer, "post_block")]
        print(f"  layer {layer} post_block: {rows} rows in {n_shards} shard(s)")
    rid = outs[0].request_id
    acts = run.request(rid, LAYERS[0])
    print(f"  request {rid!r}: layer {LAYERS[0]} activations {tuple(acts.shape)}")

    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    ids = list(outs[0].prompt_token_ids) + list(outs[0].outputs[0].token_ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[LAYERS[0] + 1][
            0
        ]
    err = float(((acts - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    print(f"  vs HF transformers on the same weights: max relative error {err:.1e}")
    print(
        "\nRead it back:  from consumers.fs import ActivationRun; "
        f"ActivationRun({str(out)!r}).request({rid!r}, {LAYERS[0]})"
    )
    ok = (
        all(m["rows"][point_key(layer, "post_block")] == expected for layer in LAYERS)
        and err < 1e-3
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
