"""Start one offline engine with actbus capturing layer 1, generate, exit: run as its own
process (``python -m tests.support.start_once MODEL ADDRESS``), so the general plugins
found on its PYTHONPATH load into it and into its engine processes."""

from __future__ import annotations

import sys


def main(model: str, address: str) -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_utilization=0.3,
        num_gpu_blocks_override=16,
        seed=0,
        additional_config={"actbus": {"publish": address, "layers": [1]}},
    )
    out = llm.generate(["the residual stream"], SamplingParams(max_tokens=4, temperature=0))
    print(f"generated {len(out[0].outputs[0].token_ids)} tokens", flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
