"""Hostile numbers on the Llama engine (issue 33): a position past int32 fails its
request by name and the engine keeps serving; a request steered as hard as the checks
allow keeps its NaN and Inf to itself, even in the KV-cache blocks later requests
reuse (the engine's cache is 17 blocks of 32 tokens: the steered request fills them)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

pytestmark = pytest.mark.engine

HUGE = 9223372036854775808  # 2**63: int64 overflow in the worker killed the engine
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest scale the checks accept


def _kv_nonfinite(worker) -> int:
    """Runs in the engine's worker: non-finite values anywhere in its KV cache."""
    import torch

    caches = worker.model_runner.kv_caches
    assert caches, "no KV cache found on the worker"
    return sum(int((~torch.isfinite(c)).sum()) for c in caches)


def _run(llm, prompts, steer=None, max_tokens=6):
    """Greedy outputs as (token ids, top-2 logprobs per step), compared bitwise."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"actbus": {"steer": steer, "steer_global": False}} if steer else None
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, extra_args=extra
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def _prompts(llm, seed: int, lengths: list[int]) -> list[list[int]]:
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_positions_past_int32_fail_their_request_and_the_engine_serves(sched_engine):
    """A capture selection and a steering entry at position 2**63, and at
    max_model_len: each a ValueError naming the field, before anything reaches the
    worker; global steering refuses them too; a neighbour is served as before."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.engine.api import set_global
    from actbus.errors import ConfigError

    llm = sched_engine.llm
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    neighbour = _prompts(llm, 81, [23])
    before = _run(llm, neighbour)
    vec = [1.0] * hidden
    bad = [
        ({"positions": [HUGE]}, "extra_args.actbus.positions[0]: position 9223372036854775808"),
        ({"positions": [3, 512]}, "extra_args.actbus.positions[1]: position 512 is past"),
        (
            {"steer": [{"vector": vec, "layers": 1, "positions": [HUGE]}]},
            "extra_args.actbus.steer[0].positions[0]: position 9223372036854775808",
        ),
        (
            {"steer": [{"vector": vec, "layers": 1, "scale": 1e39}]},
            "extra_args.actbus.steer[0].scale",
        ),
    ]
    for j, (raw, needle) in enumerate(bad):
        with pytest.raises(ValueError) as e:
            llm.llm_engine.add_request(
                f"hostile-{j}",
                TokensPrompt(prompt_token_ids=neighbour[0]),
                SamplingParams(max_tokens=2, extra_args={"actbus": raw}),
            )
        assert needle in str(e.value), (raw, str(e.value))
    with pytest.raises(ConfigError, match=r"actbus.steer.global\[0\].positions\[0\]"):
        set_global(llm, [{"vector": vec, "layers": 1, "positions": [HUGE]}])
    assert _run(llm, neighbour) == before


def test_hardest_steering_leaves_later_requests_bitwise_alone(sched_engine):
    """Steered at 1e30, then as hard as the checks allow (every scale and component at
    float32's largest), a long request fills the KV cache; its own outputs stay finite,
    the cache holds no NaN or Inf, and unrelated, unsteered requests that then reuse its
    blocks get bitwise the tokens and logprobs they got before (issue 33: NaN in reused
    blocks gave them 400s and other text)."""
    llm = sched_engine.llm
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    probes = _prompts(llm, 82, [40, 47, 54])
    long = _prompts(llm, 83, [440])  # with 20 generated: 15 of the 16 usable blocks
    before = _run(llm, probes)
    unit = [1.0] + [0.0] * (hidden - 1)
    extreme = [FLOAT32_MAX if i % 2 else -FLOAT32_MAX for i in range(hidden)]
    cases = {
        "1e30": [{"vector": unit, "layers": 1, "scale": 1e30}],
        "float32 max": [
            {
                "vector": extreme,
                "layers": [0, 2],
                "hooks": ["pre_attn", "post_attn"],
                "scale": FLOAT32_MAX,
            },
            {"vector": unit, "layers": 1, "norm_match": True, "scale": FLOAT32_MAX},
            {"vector": extreme, "layers": 3, "scale": -FLOAT32_MAX, "tier": "decode"},
        ],
    }
    for name, steer in cases.items():
        own = _run(llm, long, steer, max_tokens=20)[0]
        after = _run(llm, probes)
        assert after == before, (name, [a == b for a, b in zip(after, before, strict=True)])
        assert llm.collective_rpc(_kv_nonfinite) == [0], name
        assert all(math.isfinite(lp) for step in own[1] for _, lp in step), (name, own[1][:2])
