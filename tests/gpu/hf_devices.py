"""Does HF transformers compute a tiny model the same on CPU and on CUDA, and with each of
its MoE experts implementations? A diagnosis for a check whose oracle disagrees with the
engine at some points only (every MoE's ``mlp_out`` on an H200): prints each point's
relative error against HF's reference (fp32 on CPU, experts by HF's ``eager`` loop) for
CUDA in fp32 and bf16, with the ``eager`` and ``grouped_mm`` experts.

    python3 tests/gpu/hf_devices.py --arch qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["gpt_oss"])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    args = ap.parse_args()
    import torch
    import transformers

    from actbus.tiny_models import build_tiny_model
    from tests.support.oracle import hf_activations, max_rel_error

    torch.set_float32_matmul_precision("highest")
    hooks = ["pre_attn", "post_attn", "mlp_out", "post_block"]
    ids = list(range(3, 60))
    for arch in args.arch:
        path = build_tiny_model(
            arch, hidden_size=256, intermediate_size=512, initializer_range=0.02
        )
        ref = hf_activations(path, ids, [0, 3], hooks, dtype=torch.float32, device="cpu")
        for dtype in ("float32", "bfloat16"):
            for experts in ("eager", "grouped_mm"):
                got = hf_activations(
                    path,
                    ids,
                    [0, 3],
                    hooks,
                    dtype=getattr(torch, dtype),
                    device=args.device,
                    experts=experts,
                )
                errors = {
                    f"L{k[0]}.{k[1]}": round(max_rel_error(got[k].float().cpu(), v), 5)
                    for k, v in ref.items()
                }
                line = {"arch": arch, "dtype": dtype, "experts": experts, **errors}
                print(json.dumps({**line, "transformers": transformers.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
