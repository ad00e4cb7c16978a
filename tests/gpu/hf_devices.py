"""Does HF transformers compute a tiny model the same on CPU and on CUDA? A diagnosis for
a check whose oracle disagrees with the engine at one point only (gpt-oss's mlp_out on
an H200): prints each point's relative error between HF on the two devices, in fp32.

    python3 tests/gpu/hf_devices.py --arch gpt_oss
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="gpt_oss")
    args = ap.parse_args()
    import torch
    import transformers

    from actbus.tiny_models import build_tiny_model
    from tests.support.oracle import hf_activations, max_rel_error

    torch.set_float32_matmul_precision("highest")
    path = build_tiny_model(
        args.arch, hidden_size=256, intermediate_size=512, initializer_range=0.02
    )
    ids = list(range(3, 60))
    hooks = ["pre_attn", "post_attn", "mlp_out", "post_block"]
    cpu = hf_activations(path, ids, [0, 3], hooks, dtype=torch.float32, device="cpu")
    gpu = hf_activations(path, ids, [0, 3], hooks, dtype=torch.float32, device="cuda")
    errors = {f"L{k[0]}.{k[1]}": max_rel_error(gpu[k].float().cpu(), v) for k, v in cpu.items()}
    print(json.dumps({"arch": args.arch, "transformers": transformers.__version__, **errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
