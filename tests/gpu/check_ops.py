"""GPU check (run through the device machine, not in CI): replace, ablate and clamp
against the HF oracle on CUDA; the sibling of ``check_steer.py``.

Serves a tiny Llama with vLLM's defaults on GPU (torch.compile + CUDA graphs
FULL_AND_PIECEWISE), prefix caching on, ``actbus.steer.ops`` all three. Requests
replace rows (inline, at listed positions, and one row for generated tokens), ablate
one and two directions (at every layer; prompt tokens only), clamp a JumpReLU SAE
latent, and compose them with an ``add``; one request is untouched. Each returns the
activations of layers 0 and 3, compared with HF transformers on the same GPU and dtype
with the same operations done by hooks (``tests/support/steer_oracle.py``), on the
tokens the engine fed. Then the same requests run with new rows, directions and
values: compilations and CUDA graph captures must not change. Prints one JSON line.

    python tests/gpu/check_ops.py --dtype bfloat16 --runner v1   # or v2; --tp 2
    VLLM_CPU_CI_ENV=1 python tests/gpu/check_ops.py --device cpu --dtype float32  # dry run
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
HIDDEN = 256


def cases(seed: int, norm: float, sae_dir: str):
    """(engine entries, HF oracle entries) per request, from random values of ``seed``."""
    import torch

    from tests.support.steer_oracle import HFAblate, HFClamp, HFReplace, HFSteer

    g = torch.Generator().manual_seed(seed)

    def unit():
        v = torch.randn(HIDDEN, generator=g)
        return v / v.norm()

    rows = {p: norm * unit() for p in (2, 5, 17)}
    d1, d2, d3 = unit(), unit(), unit()
    gen_row = norm * unit()
    add = norm * unit()
    value = 2.0 + seed
    sae = _sae_tensors(sae_dir)
    return [
        (
            [
                {
                    "op": "replace",
                    "layers": 1,
                    "positions": list(rows),
                    "rows": [r.tolist() for r in rows.values()],
                }
            ],
            [HFReplace(1, "post_block", None, rows=rows)],
        ),
        (
            [
                {
                    "op": "replace",
                    "layers": 0,
                    "hooks": "pre_attn",
                    "positions": "generated",
                    "vector": gen_row.tolist(),
                }
            ],
            [HFReplace(0, "pre_attn", gen_row, positions="generated")],
        ),
        (
            [{"op": "ablate", "layers": [0, 1, 2, 3], "directions": d1.tolist()}],
            [HFAblate(la, "post_block", d1) for la in range(4)],
        ),
        (
            [
                {
                    "op": "ablate",
                    "layers": 2,
                    "hooks": "post_attn",
                    "tier": "prefill",
                    "directions": [d2.tolist(), d3.tolist()],
                },
                {"vector": add.tolist(), "layers": 2, "hooks": "post_attn"},
            ],
            [
                HFAblate(2, "post_attn", torch.stack([d2, d3]), tier="prefill"),
                HFSteer(2, "post_attn", add),
            ],
        ),
        (
            [{"op": "clamp", "layers": 1, "sae": sae_dir, "feature": 7, "value": value}],
            [HFClamp(1, "post_block", None, sae=sae, feature=7, value=value)],
        ),
        ([], []),
    ]


def _sae_tensors(directory: str):
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(directory) / "sae_weights.safetensors"
    if not path.exists():
        g = torch.Generator().manual_seed(5)
        d_sae = 16 * HIDDEN
        save_file(
            {
                "W_enc": torch.randn(HIDDEN, d_sae, generator=g) / HIDDEN**0.5,
                "b_enc": torch.randn(d_sae, generator=g) * 0.1,
                "b_dec": torch.randn(HIDDEN, generator=g) * 0.1,
                "W_dec": torch.randn(d_sae, HIDDEN, generator=g) / d_sae**0.5,
                "threshold": torch.rand(d_sae, generator=g) * 0.05,
            },
            str(path),
        )
        cfg = {"architecture": "jumprelu", "d_in": HIDDEN, "d_sae": d_sae}
        (Path(directory) / "cfg.json").write_text(json.dumps(cfg))
    return load_file(str(path))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--runner", default="v1", choices=["v1", "v2"])
    ap.add_argument("--tol", type=float, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    from tests.support.installed import require_actbus_plugin

    require_actbus_plugin()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(compile_counts)

    import torch

    from actbus.tiny_models import build_tiny_model
    from tests.support.compile_counts import compile_counts
    from tests.support.oracle import max_rel_error
    from tests.support.steer_oracle import hf_steered_forward

    path = build_tiny_model("llama", hidden_size=HIDDEN, intermediate_size=512)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        str(path),
        dtype=args.dtype,
        gpu_memory_utilization=0.3,
        max_model_len=640,
        max_num_batched_tokens=256,
        max_num_seqs=32,
        enable_prefix_caching=True,
        tensor_parallel_size=args.tp,
        seed=0,
        additional_config={
            "actbus": {
                "publish": f"ipc://{tempfile.mkdtemp()}/bus.sock",
                "layers": LAYERS,
                "hooks": HOOKS,
                "requests": "selected",
                "steer": {
                    "hooks": ["pre_attn", "post_attn", "post_block"],
                    "ops": ["replace", "ablate", "clamp"],
                },
            }
        },
    )
    start_s = time.monotonic() - t0
    dt = getattr(torch, args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(24 + 13 * i)] for i in range(6)]
    _, acts = hf_steered_forward(
        path, prompts[0], len(prompts[0]), [], [1], dtype=dt, device=args.device
    )
    norm = float(acts[(1, "pre_attn")].float().norm(dim=-1).mean())
    sae_dir = tempfile.mkdtemp(prefix="check-ops-sae-")

    def run(batch):
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=24,
                ignore_eos=True,
                extra_args={"actbus": {"steer": e, "return": True}},
            )
            for e, _ in batch
        ]
        toks = [TokensPrompt(prompt_token_ids=p) for p in prompts[: len(batch)]]
        return llm.generate(toks, params, use_tqdm=False)

    first = cases(0, norm, sae_dir)
    outs = run(first)
    before = llm.collective_rpc(compile_counts)
    second = cases(1, norm, sae_dir)  # new rows, directions, values
    outs2 = run(second)
    after = llm.collective_rpc(compile_counts)

    precision_found = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    worst: dict[str, float] = {}
    problems: list[str] = []
    rows = 0
    for out, (_, hf) in [*zip(outs, first, strict=True), *zip(outs2, second, strict=True)]:
        fed = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:-1]
        for h in hf:  # the oracle's tensors on the check's device
            if h.vector is not None:
                h.vector = h.vector.to(args.device)
            if getattr(h, "sae", None) is not None:
                h.sae = {k: v.to(args.device) for k, v in h.sae.items()}
            if getattr(h, "rows", None) is not None:
                h.rows = {p: r.to(args.device) for p, r in h.rows.items()}
        _, want = hf_steered_forward(
            path, fed, len(out.prompt_token_ids), hf, LAYERS, dtype=dt, device=args.device
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
    tol = args.tol or (1e-3 if args.dtype == "float32" else 3e-2)
    ok = not problems and all(e <= tol for e in worst.values()) and before == after
    report = {
        "check": "ops_oracle_gpu",
        "ok": ok,
        "dtype": args.dtype,
        "runner_requested": args.runner,
        "tp": args.tp,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "engine_start_s": round(start_s, 1),
        "rows_checked": rows,
        "max_rel_err": worst,
        "tolerance": tol,
        "compile_counts_first": before,
        "after_new_values": after,
        "fp32_matmul_precision_found": precision_found,
        "problems": problems[:10],
    }
    print(json.dumps(report))
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
