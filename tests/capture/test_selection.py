"""Per-request selections, aborts and n>1 on the real Llama engine.

The engine captures every request by default (``requests: all``); a request's
``extra_args["actbus"]`` replaces that for the request. The engine runs with
prefix caching and a KV cache too small for its batches, so these requests are
also preempted and served partly from the cache.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.support.engine import CAPTURE_LAYERS, HOOKS
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.prompts import expected_positions, shared_prefix_prompts
from tests.support.recorder import RowRecorder

pytestmark = pytest.mark.engine


def test_positions_layers_hooks_and_tags_per_request(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompts = shared_prefix_prompts(vocab, 8, seed=5)
    llm.generate(  # warm the prefix cache with the same prompts, uncaptured
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, extra_args={"actbus": False}),
        use_tqdm=False,
    )
    plen = len(prompts[5])
    selections = [
        {"positions": "all", "layers": [3], "hooks": ["post_block"], "tags": {"label": 0}},
        {"positions": "prompt", "hooks": ["pre_attn", "mlp_out"]},
        {"positions": "generated", "layers": [0]},
        {"positions": "last_prompt", "tags": {"label": 1, "split": "train"}},
        {"positions": "last", "hooks": ["post_attn"]},
        {"positions": [0, 7, plen + 2], "layers": "all"},
        json.dumps({"positions": "last_prompt", "layers": [0]}),  # the HTTP form
        False,  # opted out
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, extra_args={"actbus": s})
        for s in selections
    ]
    col = RowRecorder(sched_engine.address)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        col.wait_ended([(o.request_id, 0) for o in outs[:-1]])
        time.sleep(0.5)  # an opted-out request would have sent rows by now
    finally:
        col.close()
    for o, raw in zip(outs, selections, strict=True):
        got = {k[2:]: v for k, v in col.rows.items() if k[0] == o.request_id and v.positions}
        if raw is False:
            assert not got and (o.request_id, 0) not in col.ended, "opted-out request captured"
            continue
        sel = json.loads(raw) if isinstance(raw, str) else raw
        layers = CAPTURE_LAYERS if sel.get("layers", "all") == "all" else sel["layers"]
        hooks = sel.get("hooks", HOOKS)
        fed = (list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[:-1]
        want = expected_positions(sel["positions"], len(o.prompt_token_ids), len(fed))
        assert set(got) == {(layer, hook) for layer in layers for hook in hooks}, (sel, set(got))
        ref = hf_activations(sched_engine.model_path, fed, CAPTURE_LAYERS, HOOKS)
        for (layer, hook), rows in got.items():
            pos, tok, acts = rows.sorted()
            assert pos.tolist() == want, (sel, layer, hook, pos.tolist())
            assert tok.tolist() == [fed[p] for p in want]
            err = max_rel_error(acts, ref[(layer, hook)][np.asarray(want)])
            assert err <= 1e-3, (sel, layer, hook, err)
        assert col.tags[(o.request_id, 0)] == sel.get("tags", {})
        assert col.ended[(o.request_id, 0)] == "length"


def _nested(depth: int) -> object:
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


BAD = [
    ({"hooks": ["resid_mid"]}, "extra_args.actbus.hooks[0]: unknown hook 'resid_mid'"),
    ({"layers": [9]}, "extra_args.actbus.layers[0]: layer 9 is out of range"),
    ({"layers": [1]}, "extra_args.actbus.layers[0]: layer 1 is not tapped by this engine"),
    ({"layers": "first"}, "extra_args.actbus.layers: expected a non-empty list"),
    ({"positions": "middle"}, "extra_args.actbus.positions: unknown mode 'middle'"),
    ({"positions": [-1]}, "extra_args.actbus.positions[0]: expected a 0-based token position"),
    ({"tags": ["a"]}, "extra_args.actbus.tags: expected a mapping"),
    # Tags every subscriber would refuse (and with them the whole step's messages).
    ({"tags": {"deep": _nested(17)}}, "extra_args.actbus.tags: nested deeper than 16"),
    ({"tags": {"raw": b"\x00"}}, "extra_args.actbus.tags: a value of type bytes"),
    ({"tags": {"m": {1: "x"}}}, "extra_args.actbus.tags: 1 is not a string"),
    (  # every key a request may give, the steering and monitor ones too
        {"layer": [3]},
        "extra_args.actbus.layer: unknown key; valid keys are layers, hooks, positions, tags, "
        "return (capture); steer, steer_global (steering); monitor, monitor_global, "
        "monitor_return (monitors)",
    ),
    ("{not json", "extra_args.actbus: not valid JSON"),
    (7, "extra_args.actbus: expected a mapping"),
]


def test_bad_selection_fails_that_request_alone(sched_engine):
    """A bad selection is refused before it is queued; requests in flight finish whole."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    eng = llm.llm_engine
    vocab = llm.get_tokenizer().vocab_size
    prompts = shared_prefix_prompts(vocab, 3, seed=9)
    col = RowRecorder(sched_engine.address)
    try:
        for i, p in enumerate(prompts):
            eng.add_request(
                f"good-{i}",
                TokensPrompt(prompt_token_ids=p),
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            )
        eng.step()  # the good ones are running
        for j, (raw, needle) in enumerate(BAD):
            with pytest.raises(ValueError) as e:
                eng.add_request(
                    f"bad-{j}",
                    TokensPrompt(prompt_token_ids=prompts[0]),
                    SamplingParams(max_tokens=4, extra_args={"actbus": raw}),
                )
            assert needle in str(e.value), (raw, str(e.value))
        with pytest.raises(ValueError, match="request_id: 5000 characters, more than the 4096"):
            eng.add_request(  # an id subscribers would refuse
                "x" * 5000,
                TokensPrompt(prompt_token_ids=prompts[0]),
                SamplingParams(max_tokens=4, extra_args={"actbus": {"tags": {"a": 1}}}),
            )
        finished = {}
        deadline = time.monotonic() + 120
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
        assert sorted(finished) == [f"good-{i}" for i in range(3)]
        col.wait_ended([(rid, 0) for rid in finished])
    finally:
        col.close()
    for rid, out in finished.items():
        fed_len = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        pos, _, _ = col.get(rid, 3, "post_block")
        assert pos.tolist() == list(range(fed_len)), rid
    assert not any(k[0].startswith("bad-") for k in col.rows)


def test_abort_marks_partial_data(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    eng = llm.llm_engine
    vocab = llm.get_tokenizer().vocab_size
    p = shared_prefix_prompts(vocab, 1, seed=11)[0]
    col = RowRecorder(sched_engine.address)
    try:
        eng.add_request(
            "doomed",
            TokensPrompt(prompt_token_ids=p),
            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
        )
        eng.add_request(
            "survivor",
            TokensPrompt(prompt_token_ids=p[:30]),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        )
        for _ in range(8):
            eng.step()
        eng.abort_request(["doomed"])
        deadline = time.monotonic() + 120
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            eng.step()
        col.wait_ended([("doomed", 0), ("survivor", 0)])
    finally:
        col.close()
    assert col.ended[("doomed", 0)] == "abort" and col.ended[("survivor", 0)] == "length"
    pos, tok, acts = col.get("doomed", 0, "pre_attn")
    k = len(pos)
    assert len(p) < k < len(p) + 199, f"doomed: {k} rows; the abort was not mid-generation"
    assert pos.tolist() == list(range(k)), "partial data must still be contiguous"
    ref = hf_activations(sched_engine.model_path, tok.tolist(), [0], ["pre_attn"])
    assert max_rel_error(acts, ref[(0, "pre_attn")]) <= 1e-3
    pos, _, _ = col.get("survivor", 3, "post_block")
    assert pos.tolist() == list(range(30 + 19))


def test_parallel_sampling_children_are_attributed(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    p = shared_prefix_prompts(vocab, 1, seed=13)[0]
    col = RowRecorder(sched_engine.address)
    try:
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=p)],
            SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )[0]
        col.wait_ended([(out.request_id, i) for i in range(3)])
    finally:
        col.close()
    assert len(out.outputs) == 3
    for child in out.outputs:
        fed = (list(out.prompt_token_ids) + list(child.token_ids))[:-1]
        pos, tok, acts = col.get(out.request_id, 3, "post_block", sample=child.index)
        assert pos.tolist() == list(range(len(fed))), child.index
        assert tok.tolist() == fed, f"child {child.index}: rows of another sample"
        ref = hf_activations(sched_engine.model_path, fed, [3], ["post_block"])
        assert max_rel_error(acts, ref[(3, "post_block")]) <= 1e-3
