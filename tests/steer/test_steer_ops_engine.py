"""``replace``, ``ablate`` and ``clamp`` on the Llama engine (Inductor, prefix caching,
a KV cache so small it preempts, 64-token prefill chunks) against HF transformers with
the same operations hooked in (``tests/support/steer_oracle.py``): each operation and
mode, composed in one request, ``n > 1``, a batch whose untouched requests are bitwise
what they are alone, prefix caching kept apart for prompt operations and shared for
decode-only ones, and bad numbers refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actbus.steer.patch import from_capture
from tests.steer.test_steer_engine import MAX_TOKENS, _check, _prompts, _stream_norm, _vectors
from tests.steer.test_steer_requests import _generate
from tests.support.compile_counts import compile_counts
from tests.support.engine import CAPTURE_LAYERS, preemptions
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.procs import manifest, start_sink, stop, wait_for, wait_rows
from tests.support.steer_oracle import (
    HFAblate,
    HFClamp,
    HFGate,
    HFReplace,
    HFSteer,
    ops_params,
    write_sae,
)

pytestmark = pytest.mark.engine


def _params(steer=None, *, ret="all", n=1):
    return ops_params(steer, max_tokens=MAX_TOKENS, ret=ret, n=n)


def test_ops_match_hf_composed_n2_and_leave_others_bitwise_alone(sched_engine, tmp_path):
    llm = sched_engine.llm
    path = sched_engine.model_path
    vocab = llm.get_tokenizer().vocab_size
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    # 90+ tokens: prefilled in 64-token chunks
    prompts = _prompts(vocab, 6, seed=61, length=90)
    norm = _stream_norm(path, prompts[0])
    d = _vectors(hidden, 3, 1.0, seed=9)
    sae = write_sae(tmp_path / "sae", hidden, 4 * hidden, seed=3)
    clean = hf_activations(path, prompts[5], [2], ["post_block"])[(2, "post_block")]
    # patching across prompts: prompt 5's clean rows at layer 2 into prompt 1
    patch = {p: clean[p] for p in (3, 7, 30)}
    cases = [
        None,  # untouched
        [
            {
                "op": "replace",
                "layers": 2,
                "positions": list(patch),
                "rows": [r.tolist() for r in patch.values()],
            },
            {"op": "ablate", "layers": 3, "hooks": "pre_attn", "directions": d[0].tolist()},
        ],
        [  # two directions at every layer, prompt tokens; an add after it, decode
            {
                "op": "ablate",
                "layers": [0, 1, 2, 3],
                "tier": "prefill",
                "directions": [d[1].tolist(), d[2].tolist()],
            },
            {"vector": (d[0] * norm).tolist(), "layers": 1, "tier": "decode"},
        ],
        [  # clamp a latent at post_attn on the prompt, one row for generated tokens
            {
                "op": "clamp",
                "layers": 1,
                "hooks": "post_attn",
                "sae": str(tmp_path / "sae"),
                "feature": 11,
                "value": 3.0,
                "positions": "prompt",
            },
            {
                "op": "replace",
                "layers": 0,
                "hooks": "pre_attn",
                "positions": "generated",
                "vector": (d[2] * norm).tolist(),
            },
        ],
        None,  # untouched
    ]
    hf = [
        [],
        [HFReplace(2, "post_block", None, rows=patch), HFAblate(3, "pre_attn", d[0])],
        [
            *(
                HFAblate(la, "post_block", torch.stack([d[1], d[2]]), tier="prefill")
                for la in range(4)
            ),
            HFSteer(1, "post_block", d[0] * norm, tier="decode"),
        ],
        [
            HFClamp(1, "post_attn", None, positions="prompt", sae=sae, feature=11, value=3.0),
            HFReplace(0, "pre_attn", d[2] * norm, positions="generated"),
        ],
        [],
    ]
    before = llm.collective_rpc(compile_counts)
    preempted = preemptions(llm)
    n2 = _params(cases[2], n=2)
    params = [_params(c) for c in cases[:2]] + [n2] + [_params(c) for c in cases[3:]]
    # first, a long request that holds most of the KV cache: the later ones get preempted
    from vllm import SamplingParams

    filler = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = _generate(
        llm, [_prompts(vocab, 1, seed=62, length=171)[0], *prompts[:5]], [filler, *params]
    )[1:]
    assert preemptions(llm) > preempted, "the batch was meant to preempt"
    for out, want in zip(outs, hf, strict=True):
        _check(out, path, want)
    # both samples of the n=2 request are the greedy, ablated sequence
    assert len(outs[2].outputs) == 2
    assert list(outs[2].outputs[1].token_ids) == list(outs[2].outputs[0].token_ids)
    # the untouched requests: bitwise what they are in a batch with no operations
    alone = _generate(llm, [prompts[0], prompts[4]], [_params(), _params()])
    for mixed, plain in zip((outs[0], outs[4]), alone, strict=True):
        assert list(mixed.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
        ma, pa = mixed.outputs[0].activations, plain.outputs[0].activations
        for key in ma.tensors:
            assert torch.equal(ma[key], pa[key]), key
    # a returned capture patched into another request (from_capture), new values:
    # still no recompile
    src = alone[0].outputs[0].activations
    entry = from_capture(src, 0, "post_block", [2, 5])
    out = _generate(llm, [prompts[3]], [_params([entry])])[0]
    rows = {2: src[(0, "post_block")][2], 5: src[(0, "post_block")][5]}
    _check(out, path, [HFReplace(0, "post_block", None, rows=rows)])
    assert llm.collective_rpc(compile_counts) == before


def test_prefix_cache_apart_for_prompt_ops_and_shared_for_decode_ones(sched_engine):
    """A prompt replaced (or ablated) must not read KV cached without it; an operation
    on generated tokens only keeps the prompt's cache hits."""
    llm = sched_engine.llm
    path = sched_engine.model_path
    vocab = llm.get_tokenizer().vocab_size
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompt = _prompts(vocab, 1, seed=71, length=80)[0]  # two full 32-token blocks, and more
    row = _vectors(hidden, 1, _stream_norm(path, prompt), seed=12)[0]
    d = _vectors(hidden, 1, 1.0, seed=13)[0]
    replaced = [{"op": "replace", "layers": 1, "positions": [4], "rows": [row.tolist()]}]
    decode = [{"op": "ablate", "layers": 2, "tier": "decode", "directions": d.tolist()}]
    runs = [None, replaced, replaced, decode]
    outs = [_generate(llm, [prompt], [_params(s, ret="generated")])[0] for s in runs]
    cached = [o.num_cached_tokens for o in outs]
    assert cached[1] == 0, f"a replaced prompt read the plain prompt's cached KV: {cached}"
    assert cached[2] >= 64 and cached[3] >= 64, cached
    for o in outs[1:3]:
        _check(o, path, [HFReplace(1, "post_block", None, rows={4: row})], positions="generated")
    _check(outs[3], path, [HFAblate(2, "post_block", d, tier="decode")], positions="generated")


def test_bad_numbers_are_refused_naming_the_field(sched_engine, tmp_path):
    llm = sched_engine.llm
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompt = [5, 6, 7, 8]
    ok = [0.0] * hidden
    bad = {
        r"steer\[0\]\.rows\[1\]\[2\]": {
            "op": "replace",
            "layers": 1,
            "positions": [0, 1],
            "rows": [ok, [0.0, 0.0, float("nan"), *ok[3:]]],
        },
        r"steer\[0\]\.positions: 'rows' needs": {
            "op": "replace",
            "layers": 1,
            "positions": [0],
            "rows": [ok, ok],
        },
        r"steer\[0\]\.positions\[0\]: position": {
            "op": "replace",
            "layers": 1,
            "positions": [2**40],
            "rows": [ok],
        },
        r"steer\[0\]\.directions: the directions are zero or linearly dependent": {
            "op": "ablate",
            "layers": 1,
            "directions": [[1.0, *ok[1:]], [2.0, *ok[1:]]],
        },
        r"steer\[0\]\.value: expected a latent's value": {
            "op": "clamp",
            "layers": 1,
            "sae": str(tmp_path),
            "feature": 0,
            "value": 1e39,
        },
        r"steer\[0\]\.feature: expected a latent index": {
            "op": "clamp",
            "layers": 1,
            "sae": str(tmp_path),
            "feature": -1,
            "value": 1.0,
        },
        r"steer\[0\]\.scale: unknown key for op 'ablate'": {
            "op": "ablate",
            "layers": 1,
            "directions": ok,
            "scale": 2.0,
        },
    }
    for match, entry in bad.items():
        with pytest.raises(ValueError, match=match):
            _generate(llm, [prompt], [_params([entry], ret=None)])
    # the engine serves on
    out = _generate(llm, [prompt], [_params(ret=None)])[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    assert np.isfinite(np.asarray(out.outputs[0].token_ids)).all()


def test_replace_from_a_stored_run(sched_engine, tmp_path):
    """Patching from the fs sink's files: a clean request's rows, published by the engine
    and stored by a real ``actbus run fs-sink`` process, read back by
    ``consumers.fs.patching.from_run`` (run directory, request id, layer and hook,
    positions; moved to other positions and another layer) and replaced into another
    prompt: HF with those rows set by a hook gives the same."""
    from consumers.fs import ActivationRun
    from consumers.fs.patching import from_run

    llm = sched_engine.llm
    path = sched_engine.model_path
    prompts = _prompts(llm.get_tokenizer().vocab_size, 2, seed=81)
    out = tmp_path / "run"
    sink = start_sink(sched_engine.address, out)
    try:
        wait_for(lambda: manifest(out), 60, "the sink to subscribe")
        clean = _generate(llm, [prompts[0]], [_params(ret=None)])[0]
        wait_rows(out, CAPTURE_LAYERS[0], len(prompts[0]) + MAX_TOKENS - 1)
    finally:
        assert stop(sink) == 0, (out.parent / "run.log").read_text()[-3000:]
    entry = from_run(out, clean.request_id, 0, "post_block", [2, 5, 11], at=[4, 9, 1], to_layer=1)
    assert entry["layers"] == 1 and entry["positions"] == [4, 9, 1]
    _, stored = ActivationRun(out).request_rows(clean.request_id, 0, "post_block")
    hf = hf_activations(path, prompts[0], [0], ["post_block"])[(0, "post_block")]
    assert max_rel_error(stored[[2, 5, 11]], hf[[2, 5, 11]]) <= 1e-3  # the clean run's rows
    got = _generate(llm, [prompts[1]], [_params([entry])])[0]
    rows = {4: stored[2], 9: stored[5], 1: stored[11]}
    _check(got, path, [HFReplace(1, "post_block", None, rows=rows)])
    with pytest.raises(KeyError, match=r"has no rows at positions \[500\]"):
        from_run(out, clean.request_id, 0, "post_block", [2, 500])


def test_gated_ops_match_hf(sched_engine, tmp_path):
    """Each operation under a gate (``test_steer_gate_engine.py``'s monitors): its change
    times the gate, as HF's hooks apply it; a hard gate on the same token's score, a
    sigmoid one, a hard one on the previous token's."""
    from tests.steer.test_steer_gate_engine import _scorer

    llm = sched_engine.llm
    path = sched_engine.model_path
    mons = sched_engine.monitor["monitors"]
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompts = _prompts(llm.get_tokenizer().vocab_size, 3, seed=93, length=40)
    norm = _stream_norm(path, prompts[0])
    row, d = _vectors(hidden, 2, 1.0, seed=17)
    sae = write_sae(tmp_path / "sae", hidden, 4 * hidden, seed=4)
    value = norm / float(sae["W_dec"][6].norm())
    raw = _scorer(mons, "raw")  # layer 2 post_block
    stream = hf_activations(path, prompts[0], [2], ["post_block"])[(2, "post_block")]
    scores = raw(stream).sort().values
    thr = float(scores[len(scores) // 2 - 1] + scores[len(scores) // 2]) / 2  # splits them
    gates = [
        ({"monitor": "raw", "threshold": thr}, HFGate((2, "post_block"), raw, thr)),
        (
            {"monitor": "probe", "layer": 1, "threshold": 0.5, "sharpness": 8.0},
            HFGate((1, "post_block"), _scorer(mons, "probe"), 0.5, 8.0),
        ),
        (
            {"monitor": "raw", "threshold": thr, "source": "previous"},
            HFGate((2, "post_block"), raw, thr, None, "previous"),
        ),
    ]
    entries = [
        {"op": "replace", "layers": 3, "hooks": "post_attn", "vector": (row * norm).tolist()},
        {"op": "ablate", "layers": 2, "hooks": "pre_attn", "directions": d.tolist()},
        {"op": "clamp", "layers": 3, "hooks": "pre_attn", "sae": str(tmp_path / "sae"),
         "feature": 6, "value": value},
    ]  # fmt: skip
    hf = [
        HFReplace(3, "post_attn", row * norm),
        HFAblate(2, "pre_attn", d),
        HFClamp(3, "pre_attn", None, sae=sae, feature=6, value=value),
    ]
    params = [_params([{**e, "gate": g}]) for e, (g, _) in zip(entries, gates, strict=True)]
    outs = _generate(llm, prompts, params)
    for out, h, (_, gate) in zip(outs, hf, gates, strict=True):
        h.gate = gate
        _check(out, path, [h])


def test_table_rows_bounded_per_request_and_a_full_table_makes_requests_wait(sched_engine):
    """The Llama engine's table has 8 x 16 + 1 rows (max_num_seqs 16), 128 usable, and
    one request may hold 16 (an eighth). A request with 17 distinct rows is refused,
    naming the bound; nine requests of 16 distinct rows each, sent together, need 144:
    the last waits for rows and is then steered exactly as when it runs alone, and so
    are the others."""
    llm = sched_engine.llm
    path = sched_engine.model_path
    vocab = llm.get_tokenizer().vocab_size
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    # 20 tokens and 6 generated: no block is ever full, so no run reads another's KV
    prompts = [_prompts(vocab, 1, seed=81 + i, length=20)[0] for i in range(9)]
    norm = _stream_norm(path, prompts[0])

    def rows(i: int, n: int = 16) -> list[dict]:
        r = _vectors(hidden, n, norm, seed=100 + i)
        entry = {"op": "replace", "layers": 1, "positions": list(range(n))}
        return [{**entry, "rows": [v.tolist() for v in r]}]

    with pytest.raises(
        ValueError,
        match=r"17 distinct vectors .* at most 16 rows of the "
        r"engine's steering table \(actbus\.steer\.max_request_vectors\)",
    ):
        _generate(llm, [prompts[0]], [_params(rows(0, 17), ret=None)])
    batch = _generate(llm, prompts, [_params(rows(i), ret="generated") for i in range(9)])
    for i in (8, 0):
        alone = _generate(llm, [prompts[i]], [_params(rows(i), ret="generated")])[0]
        got, want = batch[i].outputs[0], alone.outputs[0]
        assert list(got.token_ids) == list(want.token_ids), f"request {i} was not steered"
        for key in want.activations.tensors:
            assert torch.equal(got.activations[key], want.activations[key]), (i, key)
