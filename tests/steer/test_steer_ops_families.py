"""``replace``, ``ablate``, ``clamp`` and a user hook on a second family, Gemma 2 (norms
after attention and after the MLP, scaled embeddings, sliding-window layers), against
HF transformers with the same operations hooked in (``tests/support/steer_oracle.py``),
as ``test_steer_ops_engine.py`` does on the Llama engine.

One in-process, Dynamo-only engine (about 2 s to start) with prefix caching, 32-token
prefill chunks and a KV cache of a few blocks, so the batch is chunked and preempted:
every operation at every steerable point (``post_attn`` included), each SAE kind that
``clamp`` accepts (JumpReLU; ReLU that does not subtract ``b_dec`` from its input),
``n > 1``, a hook composed with an operation, untouched requests bitwise what they are
alone; then a prompt's cache kept apart for prompt operations and hooks and shared for
decode-only operations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from actbus.hooks import Hook
from tests.support.engine import (
    HOOKS,
    STEER_HOOKS,
    preemptions,
    start_in_process,
    stop_llm,
)
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.steer_oracle import (
    HFAblate,
    HFClamp,
    HFReplace,
    HFSteer,
    check_hf,
    hf_steered_greedy,
    ops_params,
    write_sae,
)

pytestmark = pytest.mark.engine

ARCH = "gemma2"
LAYERS = [0, 3]
MAX_TOKENS = 8
CHUNK = 32  # max_num_batched_tokens: the prompts are prefilled in chunks
BLOCKS = 10  # x 32 tokens, half for the sliding-window layers: the batch must preempt
LENGTHS = [58, 60, 61, 59, 62, 57, 63, 70]  # the last: the cache test's, 2 blocks and more


@dataclass
class OpsRun:
    path: Path
    outs: list
    hf: list[list[HFSteer]]
    alone: list
    preemptions: int
    cache_outs: list
    cache_hf: list[list[HFSteer]]


def _llm(path: Path, address: str):
    return start_in_process(
        path,
        {
            "publish": address,
            "layers": LAYERS,
            "hooks": HOOKS,
            "steer": {"hooks": list(STEER_HOOKS), "ops": ["replace", "ablate", "clamp"]},
            "user_hooks": {"layers": [1], "points": ["post_block"]},
        },
        max_model_len=128,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        block_size=32,
        num_gpu_blocks_override=BLOCKS,
        enable_prefix_caching=True,
        disable_log_stats=False,  # preemptions are counted
    )


def _unit(hidden: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [v / v.norm() for v in torch.randn(n, hidden, generator=g)]


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory) -> OpsRun:
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from actbus.tiny_models import build_tiny_model

    path = build_tiny_model(ARCH)
    tmp = tmp_path_factory.mktemp("ops-gemma2")
    vocab = AutoTokenizer.from_pretrained(path).vocab_size
    rng = random.Random(39)
    prompts = [[rng.randrange(3, vocab - 1) for _ in range(n)] for n in LENGTHS]
    clean = hf_activations(path, prompts[5], [1], ["pre_attn", "post_attn"])
    hidden = clean[(1, "pre_attn")].shape[1]
    norm = float(clean[(1, "pre_attn")].norm(dim=-1).mean())
    d = _unit(hidden, 4, seed=39)
    relu = write_sae(tmp / "relu", hidden, 4 * hidden, 7, "standard", apply_b_dec_to_input=False)
    jump = write_sae(tmp / "jump", hidden, 4 * hidden, 8)
    # latents clamped to a value whose decoded change is about the stream's norm
    v_jump = norm / float(jump["W_dec"][11].norm())
    v_relu = -norm / float(relu["W_dec"][5].norm())
    patch = {p: clean[(1, "post_attn")][p] for p in (3, 7, 30)}  # prompt 5's, into 1
    shift = d[3] * norm
    add = Hook(lambda call: call.rows + shift, layer=1)  # replaces the rows it is given
    cases = [
        (None, None, []),  # untouched
        (
            [
                {
                    "op": "replace",
                    "layers": 1,
                    "hooks": "post_attn",
                    "positions": list(patch),
                    "rows": [r.tolist() for r in patch.values()],
                },
                {"op": "ablate", "layers": 2, "hooks": "pre_attn", "directions": d[0].tolist()},
            ],
            None,
            [HFReplace(1, "post_attn", None, rows=patch), HFAblate(2, "pre_attn", d[0])],
        ),
        (  # n=2: two directions at every layer on the prompt; an add while decoding
            [
                {
                    "op": "ablate",
                    "layers": [0, 1, 2, 3],
                    "tier": "prefill",
                    "directions": [d[1].tolist(), d[2].tolist()],
                },
                {"vector": (d[0] * norm).tolist(), "layers": 1, "tier": "decode"},
            ],
            None,
            [
                *(
                    HFAblate(la, "post_block", torch.stack([d[1], d[2]]), tier="prefill")
                    for la in range(4)
                ),
                HFSteer(1, "post_block", d[0] * norm, tier="decode"),
            ],
        ),
        (  # a JumpReLU latent at post_attn on the prompt; generated tokens' embeddings
            [
                {
                    "op": "clamp",
                    "layers": 1,
                    "hooks": "post_attn",
                    "sae": str(tmp / "jump"),
                    "feature": 11,
                    "value": v_jump,
                    "positions": "prompt",
                },
                {
                    "op": "replace",
                    "layers": 0,
                    "hooks": "pre_attn",
                    "positions": "generated",
                    "vector": (d[3] * norm).tolist(),
                },
            ],
            None,
            [
                HFClamp(
                    1, "post_attn", None, positions="prompt", sae=jump, feature=11, value=v_jump
                ),
                HFReplace(0, "pre_attn", d[3] * norm, positions="generated"),
            ],
        ),
        (  # a ReLU latent at every token; the last prompt token ablated at post_attn
            [
                {
                    "op": "clamp",
                    "layers": 2,
                    "sae": str(tmp / "relu"),
                    "feature": 5,
                    "value": v_relu,
                },
                {
                    "op": "ablate",
                    "layers": 3,
                    "hooks": "post_attn",
                    "positions": "last_prompt",
                    "directions": d[1].tolist(),
                },
            ],
            None,
            [
                HFClamp(2, "post_block", None, sae=relu, feature=5, value=v_relu),
                HFAblate(3, "post_attn", d[1], positions="last_prompt"),
            ],
        ),
        (  # a user hook after an operation at the same point
            [{"op": "ablate", "layers": 1, "directions": d[2].tolist()}],
            [add],
            [HFAblate(1, "post_block", d[2]), HFSteer(1, "post_block", shift)],
        ),
        (None, None, []),  # untouched
    ]
    params = [
        ops_params(s, max_tokens=MAX_TOKENS, hooks=h, n=2 if i == 2 else 1)
        for i, (s, h, _) in enumerate(cases)
    ]
    cache_prompt = prompts[7]
    row = d[3] * norm
    replaced = [{"op": "replace", "layers": 1, "positions": [4], "rows": [row.tolist()]}]
    decode = [{"op": "ablate", "layers": 2, "tier": "decode", "directions": d[0].tolist()}]
    reader = Hook(lambda call: None, layer=1)
    cache_cases = [
        (None, None, []),
        (replaced, None, [HFReplace(1, "post_block", None, rows={4: row})]),
        (replaced, None, [HFReplace(1, "post_block", None, rows={4: row})]),
        (decode, None, [HFAblate(2, "post_block", d[0], tier="decode")]),
        (None, [reader], []),
    ]
    sock = tmp / "sock"
    sock.mkdir()

    def generate(llm, ps, pp):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], pp, use_tqdm=False)

    llm = _llm(path, f"ipc://{sock}/bus.sock")
    try:
        before = preemptions(llm)
        outs = generate(llm, prompts[: len(cases)], params)
        n_pre = preemptions(llm) - before
        plain = ops_params(max_tokens=MAX_TOKENS)
        alone = generate(llm, [prompts[0], prompts[6]], [plain, plain])
        cache_outs = [
            generate(
                llm,
                [cache_prompt],
                [ops_params(s, max_tokens=MAX_TOKENS, ret="generated", hooks=h)],
            )[0]
            for s, h, _ in cache_cases
        ]
    finally:
        stop_llm(llm)
    return OpsRun(
        path,
        outs,
        [c[2] for c in cases],
        alone,
        n_pre,
        cache_outs,
        [c[2] for c in cache_cases],
    )


def test_ops_and_a_hook_match_hf_on_gemma2(ops_run):
    run = ops_run
    assert run.preemptions > 0, "the tiny KV cache did not force a preemption"
    assert all(len(o.prompt_token_ids) > CHUNK for o in run.outs)  # chunked prefill
    for i, (out, hf) in enumerate(zip(run.outs, run.hf, strict=True)):
        _, want = check_hf(out, run.path, hf, MAX_TOKENS, LAYERS, HOOKS)
        if hf:  # the operations show: ones that did nothing would pass above
            prompt = list(out.prompt_token_ids)
            plain = hf_steered_greedy(run.path, prompt, MAX_TOKENS, [], LAYERS)[1]
            assert max(max_rel_error(want[k], plain[k]) for k in want) > 1e-2, i
    # both samples of the n=2 request are the greedy, ablated sequence, rows included
    assert len(run.outs[2].outputs) == 2
    check_hf(run.outs[2], run.path, run.hf[2], MAX_TOKENS, LAYERS, HOOKS, sample=1)
    # the untouched requests: bitwise what they are in a batch with no operations
    for mixed, plain in zip((run.outs[0], run.outs[6]), run.alone, strict=True):
        assert list(mixed.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
        ma, pa = mixed.outputs[0].activations, plain.outputs[0].activations
        for key in ma.tensors:
            assert torch.equal(ma[key], pa[key]), key


def test_prompt_ops_and_hooks_keep_apart_from_cached_kv_on_gemma2(ops_run):
    """A replaced prompt and a hooked one read no KV cached without them; a decode-only
    operation reads the plain prompt's."""
    run = ops_run
    cached = [o.num_cached_tokens for o in run.cache_outs]
    assert cached[1] == 0 and cached[4] == 0, cached
    assert cached[2] >= 32 and cached[3] >= 32, cached
    for out, hf in zip(run.cache_outs, run.cache_hf, strict=True):
        check_hf(out, run.path, hf, MAX_TOKENS, LAYERS, HOOKS, positions="generated")
