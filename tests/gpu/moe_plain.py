"""Does plain vLLM (no plugin) compute a tiny MoE model as HF does on this device? A
diagnosis for a capture check whose MoE points disagree with HF: if vLLM alone
disagrees, the cause is vLLM's kernel on this shape, not actbus's tap.

Prints one JSON line per arch: the max |Δ logprob| of each prompt token between vLLM's
``prompt_logprobs`` and HF's forward, in the given dtype (fp32 rules out bf16 ties).

    VLLM_PLUGINS=no-plugin python3 tests/gpu/moe_plain.py --arch gpt_oss qwen3_moe --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["gpt_oss"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_PLUGINS", "no-plugin")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.tiny_models import build_tiny_model
    from tests.gpu.check_capture import GPU_SHAPES
    from tests.support.installed import gpu_memory
    from tests.support.oracle import hf_model

    torch.set_float32_matmul_precision("highest")
    ids = [(7 * i + 3) % 480 + 3 for i in range(96)]
    for arch in args.arch:
        path = build_tiny_model(
            arch,
            hidden_size=256,
            intermediate_size=512,
            initializer_range=0.02,
            **(GPU_SHAPES.get(arch, {}) if args.device == "cuda" else {}),
        )
        line: dict = {"arch": arch, "dtype": args.dtype}
        try:
            llm = LLM(
                str(path),
                dtype=args.dtype,
                enforce_eager=True,
                max_model_len=256,
                **gpu_memory(),
                seed=0,
            )
            out = llm.generate(
                [TokensPrompt(prompt_token_ids=ids)],
                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                use_tqdm=False,
            )[0]
            got = torch.tensor(
                [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
            )
            llm.llm_engine.engine_core.shutdown()
            del llm
            m = hf_model(str(path), getattr(torch, args.dtype), args.device)
            with torch.no_grad():
                logits = m(torch.tensor([ids], device=args.device)).logits[0].float()
            ref = logits.log_softmax(-1)[:-1].gather(
                1, torch.tensor(ids[1:], device=args.device)[:, None]
            )[:, 0]
            d = (got - ref.cpu()).abs()
            line.update(max_abs=round(float(d.max()), 5), mean_abs=round(float(d.mean()), 5))
        except Exception as e:  # a diagnosis reports and goes on
            line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
