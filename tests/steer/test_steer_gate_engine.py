"""Gated steering on the Llama engine (its monitors: ``tests/support/monitors.py``)
against HF transformers with a hook that applies the same gate: hard and sigmoid
gates, on the same token's score at an earlier point and on the previous token's
(scored before the steered point, or after it), an SAE feature's column; tokens whose
gate is closed are bitwise what the unsteered run computed; gated prefill steering
never reads the unsteered prompt's cached blocks."""

from __future__ import annotations

import pytest
import torch

from tests.steer.test_steer_engine import _check, _params, _prompts, _stream_norm, _vectors
from tests.steer.test_steer_requests import _generate
from tests.support.monitors import SPECS, expected_scores
from tests.support.oracle import hf_activations
from tests.support.steer_oracle import HFGate, HFSteer

pytestmark = pytest.mark.engine


def _scorer(source: dict, name: str, feature: int | None = None):
    """The HF-side score of monitor ``name`` (the trainers' own modules)."""
    spec = next(s for s in SPECS if s.name == name)
    col = 0 if feature is None else list(spec.features).index(feature)
    return lambda x: expected_scores(spec, source[name], x.float())[:, col]


def test_gated_steering_matches_hf_and_leaves_closed_tokens_bitwise_alone(sched_engine):
    llm = sched_engine.llm
    mons = sched_engine.monitor["monitors"]
    vocab = llm.get_tokenizer().vocab_size
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompts = _prompts(vocab, 5, seed=91, length=40)  # 40+ tokens: chunked, a cached block
    v = _vectors(hidden, 5, 2.0 * _stream_norm(sched_engine.model_path, prompts[0]), seed=9)
    raw = _scorer(mons, "raw")  # layer 2 post_block
    # A threshold that splits the first prompt's tokens (their unsteered raw scores).
    stream = hf_activations(sched_engine.model_path, prompts[0], [2], ["post_block"])
    scores = raw(stream[(2, "post_block")]).sort().values
    mid = len(scores) // 2
    thr = float(scores[mid - 1] + scores[mid]) / 2
    cases = [
        (  # same token, hard, at layer 3 post_attn on raw (layer 2 post_block)
            {"monitor": "raw", "threshold": thr},
            3,
            "post_attn",
            HFGate((2, "post_block"), raw, thr),
        ),
        (  # same token, sigmoid, on the probe's layer-1 score, norm-matched
            {"monitor": "probe", "layer": 1, "threshold": 0.5, "sharpness": 8.0},
            2,
            "pre_attn",
            HFGate((1, "post_block"), _scorer(mons, "probe"), 0.5, 8.0),
        ),
        (  # the previous token's raw score, scored before the steered point
            {"monitor": "raw", "threshold": thr, "source": "previous"},
            3,
            "post_block",
            HFGate((2, "post_block"), raw, thr, None, "previous"),
        ),
        (  # the previous token's raw score, scored after: closed on the prompt
            {"monitor": "raw", "threshold": thr, "sharpness": 2.0, "source": "previous"},
            1,
            "post_attn",
            HFGate((2, "post_block"), raw, thr, 2.0, "previous"),
        ),
        (  # an SAE feature (column 2 of sae_relu at layer 2 post_attn)
            {"monitor": "sae_relu", "feature": 9, "threshold": 0.0},
            3,
            "pre_attn",
            HFGate((2, "post_attn"), _scorer(mons, "sae_relu", 9), 0.0),
        ),
    ]
    entries = [
        [{"vector": v[i].tolist(), "layers": layer, "hooks": hook, "gate": gate}]
        for i, (gate, layer, hook, _) in enumerate(cases)
    ]
    entries[1][0].update(norm_match=True, scale=0.5)
    plain = _generate(llm, prompts, [_params() for _ in prompts])
    gated = _generate(llm, prompts, [_params(e) for e in entries])
    for i, (out, (_g, layer, hook, hf_gate)) in enumerate(zip(gated, cases, strict=True)):
        e = entries[i][0]
        steer = HFSteer(layer, hook, v[i], e.get("scale", 1.0), e.get("norm_match", False))
        steer.gate = hf_gate
        _check(out, sched_engine.model_path, [steer])
    # Closed gates: bitwise the unsteered run. Case 0 at layer 3 (steered at post_attn,
    # after attention: each prompt token's layer-3 rows see only its own gate).
    n = len(prompts[0])
    got, want = gated[0].outputs[0].activations, plain[0].outputs[0].activations
    is_open = raw(stream[(2, "post_block")]) > thr
    assert 5 <= int(is_open.sum()) <= n - 5, is_open
    for h in ("post_attn", "mlp_out", "post_block"):
        a, b = got[(3, h)][:n], want[(3, h)][:n]
        assert torch.equal(a[~is_open], b[~is_open]), h
        opened = torch.nonzero(is_open).flatten().tolist()
        assert not any(torch.equal(a[t], b[t]) for t in opened), h
    # Case 3 (previous token, scored later): every prompt row, every layer, untouched.
    got, want = gated[3].outputs[0].activations, plain[3].outputs[0].activations
    n = len(prompts[3])
    for key in got.tensors:
        assert torch.equal(got[key][:n], want[key][:n]), key
    assert list(gated[3].outputs[0].token_ids) != list(plain[3].outputs[0].token_ids) or any(
        not torch.equal(got[k], want[k]) for k in got.tensors
    ), "the decode steps' gate should have opened"
    # Prefix caching: a gated prompt (its KV changed) never reads the plain prompt's
    # cached blocks, nor those of another gate, which a plain rerun does read; the same
    # gated steering again does (prompt rows not returned: a capture of prompt
    # positions does not read the cache).
    other = [{**entries[0][0], "gate": {**entries[0][0]["gate"], "threshold": thr + 1e-3}}]
    runs = [
        _params(ret="generated"),
        _params(other, ret="generated"),
        _params(ret="generated"),
        _params(other, ret="generated"),
    ]
    cached = [_generate(llm, prompts[:1], [p])[0].num_cached_tokens for p in runs]
    assert cached[1] == 0 and cached[2] >= 32 and cached[3] >= 32, cached
