"""Causal tracing (activation patching) inside vLLM's compiled graph.

    python examples/causal_tracing.py                    # the tiny Llama, on CPU
    python examples/causal_tracing.py --gpu --model PATH --prompt "The Eiffel Tower is in" \
        --subject "The Eiffel Tower"

1. A clean run returns every layer's ``post_block`` rows (``"return": true``) and
   the probability of its next token.
2. A corrupted run: the subject tokens' embeddings get Gaussian noise (3x the
   embeddings' standard deviation, as Meng et al. do): a ``replace`` at layer 0's
   ``pre_attn`` (the embeddings) with ``embedding + noise`` rows.
3. For each layer L, the corrupted run again, with layer L's clean state at the last
   subject token restored: a second ``replace``, the clean row taken from step 1's
   returned capture (``actbus.steer.patch.from_capture``). Both operations go in one
   request, every layer's request in one batch.

Prints the probability of the clean run's next token per layer; with ``--out`` writes
them (and the noise) as JSON, which ``tests/test_journeys.py`` checks against the same
procedure done with HF transformers' hooks. The engine must allow ``replace``
(``actbus.steer.ops``) at ``pre_attn`` and ``post_block``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import common


def embeddings(path: str):
    """The model's input embedding matrix, read from its safetensors files."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118
                if key.endswith("embed_tokens.weight"):
                    return sf.get_tensor(key).float()
    raise SystemExit(f"{path}: no embed_tokens.weight in its safetensors files")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default="Note 3 on quick brown foxes: a short one")
    p.add_argument("--subject", default="quick brown foxes", help="text inside --prompt")
    p.add_argument("--noise", type=float, default=3.0, help="x the embeddings' std")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    common.add_model_args(p)
    args = p.parse_args()
    model = common.model_of(args)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.steer.patch import from_capture, replace_entry

    num_layers = json.loads((Path(model.path) / "config.json").read_text())["num_hidden_layers"]
    layers = list(range(num_layers))
    llm = LLM(
        model.path,
        **model.llm_kwargs(),
        max_logprobs=-1,
        additional_config={
            "actbus": {
                "publish": f"ipc://{tempfile.mkdtemp(prefix='actbus-trace-')}/bus.sock",
                "layers": layers,
                "hooks": ["post_block"],
                "requests": "selected",
                "steer": {"hooks": ["pre_attn", "post_block"], "ops": ["replace"]},
            }
        },
    )
    tok = llm.get_tokenizer()
    ids = tok(args.prompt)["input_ids"]
    start = args.prompt.index(args.subject)
    enc = tok(args.prompt, return_offsets_mapping=True)
    subject = [
        i
        for i, (a, b) in enumerate(enc["offset_mapping"])
        if b > start and a < start + len(args.subject)
    ]
    last = subject[-1]

    def params(steer=None, ret=False):
        actbus = {"steer": steer} if steer else {}
        if ret:
            actbus.update({"return": True, "positions": "prompt"})
        return SamplingParams(
            max_tokens=1, temperature=0, logprobs=-1, extra_args={"actbus": actbus}
        )

    prompt = TokensPrompt(prompt_token_ids=ids)
    clean = llm.generate([prompt], [params(ret=True)], use_tqdm=False)[0]
    target = clean.outputs[0].token_ids[0]

    def prob(out) -> float:
        return float(torch.tensor(out.outputs[0].logprobs[0][target].logprob).exp())

    emb = embeddings(model.path)
    g = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(len(subject), emb.shape[1], generator=g) * args.noise * float(emb.std())
    corrupt = replace_entry(
        subject, emb[ids][subject] + noise, layers=0, hooks="pre_attn", tier="prefill"
    )
    acts = clean.outputs[0].activations
    restore = [from_capture(acts, layer, "post_block", [last]) for layer in layers]
    outs = llm.generate(
        [prompt] * (1 + len(layers)),
        [params([corrupt])] + [params([corrupt, r]) for r in restore],
        use_tqdm=False,
    )
    result = {
        "prompt_ids": ids,
        "subject": subject,
        "target": target,
        "noise": noise.tolist(),
        "clean": prob(clean),
        "corrupted": prob(outs[0]),
        "restored": [prob(o) for o in outs[1:]],
    }
    print(f"next token {tok.decode([target])!r}; subject tokens {subject}")
    print(f"clean p = {result['clean']:.4f}   corrupted p = {result['corrupted']:.4f}")
    print("layer  restored p  recovered")
    span = result["clean"] - result["corrupted"]
    for layer, pr in zip(layers, result["restored"], strict=True):
        frac = (pr - result["corrupted"]) / span if span else float("nan")
        print(f"{layer:>5d}  {pr:>10.4f}  {frac:>9.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
