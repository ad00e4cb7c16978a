"""GPU check (run through the device machine, not in CI): the capture oracle on CUDA.

Serves a tiny Llama with vLLM's defaults on GPU (torch.compile + CUDA graphs
FULL_AND_PIECEWISE), with prefix caching on, prompts sharing prefixes and a KV
cache small enough to force preemption. Captures every hook point of layers 0
and 3 for every request, plus per-request selections (positions modes, tags) and
an n=2 request, through a real ZeroMQ subscriber, and compares every row with HF
transformers on the same GPU and dtype. One request also asks for its rows back
(``"return": true``): they must equal the subscriber's exactly. ``--tp``/``--pp``
run the same check tensor- or pipeline-parallel. Prints one JSON line.

    python tests/gpu/check_capture.py --dtype bfloat16 --runner v2 [--tp 2 | --pp 2]
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
SELECTIONS = [
    {"positions": "last_prompt", "tags": {"label": 1}},
    {"positions": "generated", "layers": [3], "hooks": ["post_block"]},
    {"positions": [0, 5, 9], "hooks": ["mlp_out"]},
    {"positions": "last", "layers": [0]},
    {"layers": [3], "hooks": ["post_block", "pre_attn"], "return": True},
]


# Shapes the GPU kernels take where the CPU's differ: MLA's prefill kernels (FlashAttention)
# run DeepSeek's own head dims only (vLLM's mla/prefill/flash_attn.py).
GPU_SHAPES = {"deepseek_v2": {"qk_nope_head_dim": 128, "v_head_dim": 128}}


def kv_cache_groups(path: Path) -> int:
    """How many KV cache groups vLLM makes for the model: one per attention type in
    ``layer_types`` (sliding and full). A block count is shared between the groups, and a
    sliding group reserves a chunk and its window, so each group gets ``--blocks``."""
    cfg = json.loads((path / "config.json").read_text())
    return max(1, len(set(cfg.get("text_config", cfg).get("layer_types") or [])))


def _positions(mode, prompt_len: int, fed_len: int) -> list[int]:
    if not isinstance(mode, str):
        return [p for p in mode if p < fed_len]
    return {
        "last_prompt": [prompt_len - 1],
        "generated": list(range(prompt_len, fed_len)),
        "last": [fed_len - 1],
    }[mode]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--runner", default="v2", choices=["v1", "v2"])
    ap.add_argument("--tol", type=float, default=None)
    # A random model with large weights is chaotic: bf16 and fp32 runs of HF itself then
    # differ by 20-30% after two layers (measured), so the oracle uses the HF default.
    ap.add_argument("--init", type=float, default=0.02, help="initializer_range")
    ap.add_argument("--blocks", type=int, default=48, help="KV blocks of 16: forces preemption")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    ap.add_argument("--attention-backend", default=None, help="e.g. FLEX_ATTENTION")
    ap.add_argument(
        "--arch",
        default="llama",
        help="the tiny model's builder (actbus.tiny_models); an MoE one adds the router hook",
    )
    args = ap.parse_args()
    from tests.support.installed import gpu_memory, require_actbus_plugin

    require_actbus_plugin()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"

    import torch

    from actbus.streams import point_key
    from actbus.tiny_models import MOE_ARCHITECTURES, build_tiny_model
    from tests.support.oracle import hf_activations, max_rel_error
    from tests.support.recorder import RowRecorder

    # head_dim 64: what GPU attention kernels support in every dtype.
    path = build_tiny_model(
        args.arch,
        hidden_size=256,
        intermediate_size=512,
        initializer_range=args.init,
        **(GPU_SHAPES.get(args.arch, {}) if args.device == "cuda" else {}),
    )
    moe = args.arch in MOE_ARCHITECTURES
    multimodal = "vision_config" in json.loads((path / "config.json").read_text())
    engine_hooks = HOOKS + (["router"] if moe else [])
    # DeepSeek's first layers are dense (no router): tap its first MoE layer instead of 0.
    first_moe = json.loads((path / "config.json").read_text()).get("first_k_dense_replace") or 0
    tapped = [max(LAYERS[0], first_moe), *LAYERS[1:]] if moe else LAYERS
    selections = [
        {**s, "layers": [tapped[0] if x == LAYERS[0] else x for x in s["layers"]]}
        if "layers" in s
        else s
        for s in SELECTIONS
    ]
    address = f"ipc://{tempfile.mkdtemp()}/bus.sock"
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
        block_size=16 if args.device == "cuda" else 32,
        num_gpu_blocks_override=args.blocks * kv_cache_groups(path),
        disable_log_stats=False,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
        # a multimodal wrapper (gemma3mm, paligemma, idefics3): text-only prompts, and no
        # image processor (none is saved with the tiny models)
        **({"limit_mm_per_prompt": {"image": 0}} if multimodal else {}),
        seed=0,
        additional_config={"actbus": {"publish": address, "layers": tapped, "hooks": engine_hooks}},
    )
    start_s = time.monotonic() - t0
    col = RowRecorder(address)
    from actbus.bus.protocol import Subscription

    routes = RowRecorder(address, Subscription(window=1024, hooks=("router",))) if moe else None
    info = col.sub.welcome or {}
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    lengths = [3, 8, 17, 40, 63, 100, 130, 200, 257, 300, 380, 511, 5, 12, 90, 150]
    prompts = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(3, 500) for _ in range(n)]
        prompts.append(shared[: n // 2] + ids[n // 2 :] if i % 2 else ids)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True) for _ in prompts]
    for sel in selections:
        prompts.append(prompts[len(params) % 8])
        params.append(
            SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, extra_args={"actbus": sel}
            )
        )
    prompts.append(prompts[3])
    params.append(SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    preempt = sum(
        int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"
    )
    col.wait(lambda c: all((o.request_id, x.index) in c.ended for o in outs for x in o.outputs), 60)
    col.close()

    # The oracle computes in full precision whatever the engine set in this process
    # (TF32 matmuls would put HF itself ~1e-3 off in fp32).
    precision_found = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    dt = getattr(torch, args.dtype)
    worst: dict[str, float] = {}
    problems: list[str] = []
    checked_rows = 0
    for o, sp in zip(outs, params, strict=True):
        sel = (sp.extra_args or {}).get("actbus") or {}
        for child in o.outputs:
            fed = (list(o.prompt_token_ids) + list(child.token_ids))[:-1]
            want = (
                list(range(len(fed)))
                if "positions" not in sel
                else _positions(sel["positions"], len(o.prompt_token_ids), len(fed))
            )
            layers = sel.get("layers", tapped)
            hooks = sel.get("hooks", HOOKS)
            ref = hf_activations(path, fed, tapped, HOOKS, dtype=dt, device=args.device)
            acts_back = getattr(child, "activations", None)
            if sel.get("return") and (acts_back is None or not acts_back.complete):
                problems.append(f"{o.request_id}/{child.index}: returned rows missing")
            elif not sel.get("return") and acts_back is not None:
                problems.append(f"{o.request_id}/{child.index}: rows returned unasked")
            if col.tags.get((o.request_id, child.index)) != sel.get("tags", {}):
                problems.append(f"{o.request_id}: tags {col.tags.get((o.request_id, 0))}")
            if routes is not None and "hooks" not in sel and "positions" not in sel:
                from tests.support.router_oracle import hf_routing, split_sorted

                routing = hf_routing(path, fed)
                for layer in tapped:
                    pos, _, rows = routes.get(o.request_id, layer, "router", child.index)
                    if pos.tolist() != want:
                        problems.append(f"{o.request_id} L{layer} router: positions")
                        continue
                    ids, weights = split_sorted(rows)
                    ref_ids, ref_w = routing[layer]
                    same = (ids == ref_ids).all(dim=-1)
                    # bf16 near-ties may swap an expert: count rows, compare weights where equal
                    worst["router_id_mismatch_frac"] = max(
                        worst.get("router_id_mismatch_frac", 0.0), 1.0 - float(same.float().mean())
                    )
                    if same.any():
                        err = float((weights[same] - ref_w[same]).abs().max())
                        worst["router_weight_abs"] = max(worst.get("router_weight_abs", 0.0), err)
            for layer in tapped:
                for hook in HOOKS:
                    pos, tok, acts = col.get(o.request_id, layer, hook, child.index)
                    if layer not in layers or hook not in hooks:
                        if len(pos):
                            problems.append(f"{o.request_id} L{layer} {hook}: not selected")
                        continue
                    if pos.tolist() != want or tok.tolist() != [fed[p] for p in want]:
                        problems.append(
                            f"{o.request_id}/{child.index} L{layer} {hook}: positions "
                            f"{len(pos)} vs {len(want)}"
                        )
                        continue
                    if acts_back is not None and not (
                        acts_back.positions.tolist() == want
                        and torch.equal(acts_back[(layer, hook)], acts)
                    ):
                        problems.append(f"{o.request_id} L{layer} {hook}: returned rows differ")
                    r = ref[(layer, hook)][torch.as_tensor(want, device=args.device)].float()
                    err = max_rel_error(acts.float().to(args.device), r)
                    worst[point_key(layer, hook)] = max(worst.get(point_key(layer, hook), 0.0), err)
                    checked_rows += len(pos)
    tol = args.tol or (1e-3 if args.dtype == "float32" else 2e-2)
    ok = not problems and all(e <= tol for e in worst.values()) and preempt > 0
    print(
        json.dumps(
            {
                "check": "capture_oracle_gpu",
                "ok": ok,
                "dtype": args.dtype,
                "runner_requested": args.runner,
                "tp": args.tp,
                "pp": args.pp,
                "attention_backend": args.attention_backend or "default",
                "arch": args.arch,
                "engine": info.get("engine"),
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "engine_start_s": round(start_s, 1),
                "initializer_range": args.init,
                "requests": len(outs),
                "preemptions": preempt,
                "rows_checked": checked_rows,
                "max_rel_err": worst,
                "tolerance": tol,
                "fp32_matmul_precision_found": precision_found,
                "problems": problems[:10],
            }
        )
    )
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
