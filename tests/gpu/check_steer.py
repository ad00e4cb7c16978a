"""GPU check (run through the device machine, not in CI): the steering oracle on CUDA.

Serves a tiny Llama with vLLM's defaults on GPU (torch.compile + CUDA graphs
FULL_AND_PIECEWISE), prefix caching on. Requests steer every point (pre_attn of layer
0, post_attn, post_block), each tier and position mode, with norm matching, by inline
vectors and by name; each returns the activations of layers 0 and 3. Every row is
compared with HF transformers on the same GPU and dtype with the same vectors added by
hooks, on the tokens the engine fed (greedy tokens of a random model in bf16 may differ
from HF's after a near-tie; the rows are what is checked). Then a named vector is
replaced and new requests run: compilations and CUDA graph captures must not change.
Prints one JSON line.

    python tests/gpu/check_steer.py --dtype bfloat16 --runner v1   # or v2; --tp 2 | --pp 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYERS = [0, 3]
HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block"]
# (entries; "vector" indexes the check's random vectors, or is the registered name "named")
CASES = [
    [{"vector": 0, "layers": 0, "hooks": "pre_attn"}],
    [{"vector": 1, "layers": 1, "hooks": "post_attn", "tier": "prefill"}],
    [{"vector": 2, "layers": 3, "tier": "decode", "scale": 1.5}],
    [{"vector": 3, "layers": 0, "norm_match": True, "scale": 0.8, "positions": [2, 5, 40]}],
    [
        {"vector": 0, "layers": 2, "hooks": "post_attn", "scale": 0.7},
        {"vector": 1, "layers": 2, "hooks": "post_attn", "norm_match": True, "scale": 0.5},
        {"vector": 2, "layers": 3, "hooks": "pre_attn", "positions": "generated"},
    ],
    [{"vector": "named", "layers": [1, 2], "positions": "prompt"}],
    [],
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--runner", default="v1", choices=["v1", "v2"])
    ap.add_argument("--tol", type=float, default=None)
    ap.add_argument("--init", type=float, default=0.02, help="initializer_range")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()
    from tests.support.installed import gpu_memory, require_actbus_plugin

    require_actbus_plugin()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(compile_counts)

    import torch

    from actbus.engine.api import vectors
    from actbus.tiny_models import build_tiny_model
    from tests.support.compile_counts import compile_counts
    from tests.support.oracle import max_rel_error
    from tests.support.steer_oracle import HFSteer, hf_steered_forward

    path = build_tiny_model(
        "llama", hidden_size=256, intermediate_size=512, initializer_range=args.init
    )
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        str(path),
        dtype=args.dtype,
        **gpu_memory(),
        max_model_len=640,
        max_num_batched_tokens=256,
        max_num_seqs=32,
        enable_prefix_caching=True,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        seed=0,
        additional_config={
            "actbus": {
                "publish": f"ipc://{tempfile.mkdtemp()}/bus.sock",
                "layers": LAYERS,
                "hooks": HOOKS,
                "requests": "selected",
                "steer": {"hooks": ["pre_attn", "post_attn", "post_block"]},
            }
        },
    )
    start_s = time.monotonic() - t0
    dt = getattr(torch, args.dtype)
    hidden = 256
    g = torch.Generator().manual_seed(0)
    vecs = [u / u.norm() for u in torch.randn(4, hidden, generator=g)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(20 + 13 * i)] for i in range(len(CASES))]
    # Vectors about as long as the stream (its norm measured on the first prompt).
    _, acts = hf_steered_forward(
        path, prompts[0], len(prompts[0]), [], [1], dtype=dt, device=args.device
    )
    norm = 2.0 * float(acts[(1, "pre_attn")].float().norm(dim=-1).mean())
    vecs = [norm * v for v in vecs]
    named = norm * torch.randn(hidden, generator=g) / 16.0

    def run(cases):
        params = []
        for case in cases:
            steer = [
                {
                    **e,
                    "vector": e["vector"]
                    if isinstance(e["vector"], str)
                    else vecs[e["vector"]].tolist(),
                }
                for e in case
            ]
            extra = {"actbus": {"steer": steer, "return": True}}
            params.append(
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, extra_args=extra)
            )
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[: len(cases)]]
        return llm.generate(batch, params, use_tqdm=False)

    vectors(llm).register("named", named)
    outs = run(CASES)
    before = llm.collective_rpc(compile_counts)
    named2 = -2.0 * named
    vectors(llm).register("named", named2)  # hot change
    outs2 = run(CASES[5:6])
    after = llm.collective_rpc(compile_counts)

    precision_found = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    worst: dict[str, float] = {}
    problems: list[str] = []
    rows = 0
    for out, case, name_vec in [
        *((o, c, named) for o, c in zip(outs, CASES, strict=True)),
        (outs2[0], CASES[5], named2),
    ]:
        steers = []
        for e in case:
            v = name_vec if isinstance(e["vector"], str) else vecs[e["vector"]]
            ls = e["layers"] if isinstance(e["layers"], list) else [e["layers"]]
            pos = e.get("positions", "all")
            steers += [
                HFSteer(
                    layer,
                    e.get("hooks", "post_block"),
                    v,
                    e.get("scale", 1.0),
                    e.get("norm_match", False),
                    e.get("tier", "base"),
                    tuple(pos) if isinstance(pos, list) else pos,
                )
                for layer in ls
            ]
        fed = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:-1]
        _, want = hf_steered_forward(
            path, fed, len(out.prompt_token_ids), steers, LAYERS, dtype=dt, device=args.device
        )
        got = out.outputs[0].activations
        if got is None or not got.complete or got.positions.tolist() != list(range(len(fed))):
            problems.append(f"{out.request_id}: returned rows missing or incomplete")
            continue
        for key, t in got.tensors.items():
            err = max_rel_error(t.float().to(args.device), want[key].float())
            k = f"{key[0]}/{key[1]}"
            worst[k] = max(worst.get(k, 0.0), err)
            rows += len(t)
    tol = args.tol or (1e-3 if args.dtype == "float32" else 2e-2)
    ok = not problems and all(e <= tol for e in worst.values()) and before == after
    report = {
        "check": "steer_oracle_gpu",
        "ok": ok,
        "dtype": args.dtype,
        "runner_requested": args.runner,
        "tp": args.tp,
        "pp": args.pp,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "engine_start_s": round(start_s, 1),
        "rows_checked": rows,
        "max_rel_err": worst,
        "tolerance": tol,
        "compile_counts_before_hot_change": before,
        "after": after,
        "fp32_matmul_precision_found": precision_found,
        "problems": problems[:10],
    }
    print(json.dumps(report))
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
