"""Journey 3: get a request's activations back in-process, with its output.

    python examples/return_in_process.py                     # the tiny Llama, on CPU
    python examples/return_in_process.py --gpu --model PATH --layers 8,16

An offline `vllm.LLM` with capture on two layers; each request's selection asks for
`"return": true`, so its rows come back on `CompletionOutput.activations`: positions,
token ids and a `[tokens, hidden]` tensor per layer and hook, for every token fed. One
request asks for its last prompt token only, as a probe's input would be. The rows are
saved to --out (default out/journey-return/activations.pt).

vLLM starts processes that import this file again, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import common


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(common.ROOT / "out" / "journey-return"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    common.add_model_args(p)
    args = p.parse_args()
    model = common.model_of(args)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    import torch
    from vllm import LLM, SamplingParams

    from actbus.streams import point_key

    address = f"ipc://{tempfile.mkdtemp(prefix='actbus-journey-')}/bus.sock"
    common.step(1, 3, f"vllm.LLM with capture on layers {list(model.layers)}")
    t0 = time.monotonic()
    llm = LLM(
        model.path,
        **model.llm_kwargs(),
        # An address of this run's own: the rows come back through the bus, as any
        # subscriber's do (the front end subscribes to the requests that ask).
        additional_config={"actbus": {"publish": address, "layers": list(model.layers)}},
    )
    print(f"      engine up in {time.monotonic() - t0:.0f}s")

    common.step(2, 3, f"{args.prompts} requests asking for their rows back")
    items = common.prompts(args.prompts)
    every = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, extra_args={"actbus": {"return": True}}
    )
    last = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        extra_args={"actbus": {"return": True, "positions": "last_prompt"}},
    )
    params = [last if i == 0 else every for i in range(len(items))]
    outs = llm.generate([text for text, _ in items], params)

    common.step(3, 3, "what came back")
    ok = True
    saved = []
    for i, o in enumerate(outs):
        acts = o.outputs[0].activations
        fed = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
        want = 1 if i == 0 else fed
        shapes = {
            point_key(layer, hook): tuple(t.shape) for (layer, hook), t in acts.tensors.items()
        }
        if i < 3:
            print(f"      request {o.request_id}: {fed} fed, {shapes}, complete={acts.complete}")
        ok = ok and acts.complete and all(t.shape[0] == want for t in acts.tensors.values())
        ok = ok and acts.positions.tolist() == (
            [len(o.prompt_token_ids) - 1] if i == 0 else list(range(fed))
        )
        saved.append(
            {
                "request_id": o.request_id,
                "positions": acts.positions,
                "token_ids": acts.token_ids,
                **{point_key(layer, hook): t for (layer, hook), t in acts.tensors.items()},
            }
        )
    torch.save(saved, out / "activations.pt")
    print(f"      {len(saved)} requests' rows saved to {out / 'activations.pt'}")
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
