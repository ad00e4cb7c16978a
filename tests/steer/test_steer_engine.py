"""Steering on the real engine against HF transformers with the same vectors hooked in.

Every shared engine can steer every layer at every point (``tests/support/engine.py``),
so the capture tests run on a graph with the steering ops in it. Here: each point,
tier, position mode and norm matching on all six architectures; named vectors from SAE
and probe checkpoints; a mixed batch whose unsteered requests are bitwise what they are
without steering; prefix caching; hot changes without recompilation; bad input.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.engine import CAPTURE_LAYERS, HOOKS
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.steer_oracle import HFSteer, check_hf, hf_steered_greedy

pytestmark = pytest.mark.engine
MAX_TOKENS = 6


def _prompts(vocab: int, n: int, seed: int, length: int = 21) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 3 * i)] for i in range(n)]


def _vectors(hidden: int, n: int, norm: float, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        v = torch.randn(hidden, generator=g)
        out.append(v / v.norm() * norm)
    return out


def _stream_norm(model_path, prompt) -> float:
    """The typical norm of the residual stream in this model (the middle layer's input)."""
    acts = hf_activations(model_path, prompt, [1], ["pre_attn"])
    return float(acts[(1, "pre_attn")].norm(dim=-1).mean())


def _entry(e: dict, vecs: list[torch.Tensor]) -> dict:
    """A request's entry: the vector inline (a list) unless it is a name."""
    v = e["vector"]
    return {**e, "vector": vecs[v].tolist() if isinstance(v, int) else v}


def _hf(e: dict, vecs) -> list[HFSteer]:
    layers = e["layers"] if isinstance(e["layers"], list) else [e["layers"]]
    hooks = e.get("hooks", "post_block")
    hooks = hooks if isinstance(hooks, list) else [hooks]
    v = vecs[e["vector"]] if isinstance(e["vector"], int) else e["_values"]
    return [
        HFSteer(
            layer,
            hook,
            v,
            e.get("scale", 1.0),
            e.get("norm_match", False),
            e.get("tier", "base"),
            tuple(e["positions"])
            if isinstance(e.get("positions"), list)
            else e.get("positions", "all"),
        )
        for layer in layers
        for hook in hooks
    ]


def _params(steer=None, *, ret: str | None = "all", **extra):
    from vllm import SamplingParams

    actbus = dict(extra)
    if steer is not None:
        actbus["steer"] = steer
    if ret is not None:
        actbus.update({"return": True, "positions": ret})
    return SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args={"actbus": actbus}
    )


def _check(out, model_path, steers: list[HFSteer], positions="all"):
    """The engine's tokens and returned activations against HF with the same steering."""
    return check_hf(out, model_path, steers, MAX_TOKENS, CAPTURE_LAYERS, HOOKS, positions)


# (entry, as a request writes it; "vector" is an index into the test's vectors)
CASES = [
    # the first layer's input: the (Gemma: scaled) embeddings
    [{"vector": 0, "layers": 0, "hooks": "pre_attn", "scale": 1.0}],
    [{"vector": 1, "layers": [1], "hooks": "post_attn", "tier": "prefill"}],
    [{"vector": 2, "layers": 3, "hooks": "post_block", "tier": "decode", "scale": 1.5}],
    [{"vector": 3, "layers": 0, "norm_match": True, "scale": 0.8, "positions": [2, 5, 23]}],
    [  # two vectors at one point add up; another point, generated tokens only
        {"vector": 4, "layers": 2, "hooks": "post_attn", "scale": 0.7},
        {"vector": 5, "layers": 2, "hooks": "post_attn", "norm_match": True, "scale": 0.5},
        {"vector": 6, "layers": 3, "hooks": "pre_attn", "positions": "generated"},
    ],
    [  # prompt positions at the first layer, the last prompt token at the last
        {"vector": 7, "layers": 0, "hooks": "post_attn", "positions": "prompt"},
        {
            "vector": 0,
            "layers": [1, 3],
            "hooks": ["pre_attn", "post_attn"],
            "positions": "last_prompt",
            "scale": 2.0,
        },
    ],
]


def test_each_point_tier_and_position_mode_matches_hf(engine):
    llm = engine.llm
    vocab = llm.get_tokenizer().vocab_size
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompts = _prompts(vocab, len(CASES) + 1, seed=5)
    vecs = _vectors(hidden, 8, 2.0 * _stream_norm(engine.model_path, prompts[0]))
    from vllm.inputs import TokensPrompt

    params = [_params([_entry(e, vecs) for e in case]) for case in CASES] + [_params()]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    _check(outs[-1], engine.model_path, [])
    changed = 0
    for out, case in zip(outs[:-1], CASES, strict=True):
        steers = [s for e in case for s in _hf(e, vecs)]
        tokens, want = _check(out, engine.model_path, steers)
        # The steering shows: vectors that did nothing would pass the check above.
        plain_tokens, plain = hf_steered_greedy(
            engine.model_path, list(out.prompt_token_ids), MAX_TOKENS, [], CAPTURE_LAYERS
        )
        assert max(max_rel_error(want[k], plain[k]) for k in want) > 1e-2, case
        changed += tokens != plain_tokens
    assert changed >= 2, "steering this strong should change some greedy tokens"
