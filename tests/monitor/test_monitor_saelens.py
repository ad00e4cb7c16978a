"""SAEs saved by SAELens itself, monitored by the shared Llama engine.

The engine's ``actbus.monitor`` entry (tests/support/monitors.py) holds three SAEs that
SAELens' ``save_model`` wrote (standard at ``model.layers.3``, JumpReLU at
``blocks.0.hook_mlp_out`` with negative thresholds among its own, TopK with
``rescale_acts_by_decoder_norm`` at ``blocks.3.hook_resid_mid``), at points the engine
also captures. Every score, at every position exactly once (chunked prefill
included), equals SAELens' own ``encode`` of the row the engine published at that
point: the same float32 numbers in, so the only difference is float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actbus.bus import Subscription
from tests.support.engine import MAX_BATCHED_TOKENS
from tests.support.monitors import SAELENS_SPECS, ScoreLog
from tests.support.recorder import RowRecorder

pytestmark = pytest.mark.engine
NAMES = tuple(s.name for s in SAELENS_SPECS)
REL_TOL = 1e-5


def _pre(sae, x: torch.Tensor) -> torch.Tensor:
    """SAELens' pre-activations of ``x`` (as its ``encode`` ranks and gates them)."""
    pre = sae.process_sae_in(x) @ sae.W_enc + sae.b_enc
    if getattr(sae.cfg, "rescale_acts_by_decoder_norm", False):
        pre = pre * sae.W_dec.norm(dim=-1)
    return pre


def test_saelens_saes_score_as_saelens_encode_on_the_engines_rows(sched_engine):
    from sae_lens import SAE
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (150, 40, 9)]  # 150: chunked
    params = SamplingParams(
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        extra_args={"actbus": {"monitor": list(NAMES)}},
    )
    recorder = RowRecorder(sched_engine.address, Subscription(layers=(0, 3), window=1024))
    log = ScoreLog(sched_engine.address, monitors=NAMES)
    try:
        prompts_in = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs = llm.generate(prompts_in, params, use_tqdm=False)
        keys = [(o.request_id, 0) for o in outs]
        log.wait_ended(keys)
        recorder.wait_ended(keys)
    finally:
        log.close()
        recorder.close()
    assert max(map(len, prompts)) > MAX_BATCHED_TOKENS
    cfg = sched_engine.monitor["monitors"]
    fired = {s.name: 0 for s in SAELENS_SPECS}
    for out, prompt in zip(outs, prompts, strict=True):
        fed = (prompt + list(out.outputs[0].token_ids))[:-1]
        for spec in SAELENS_SPECS:
            sae = SAE.load_from_disk(cfg[spec.name]["sae"])
            (layer,) = spec.layers
            key = (out.request_id, 0, spec.name, layer)
            rows = sorted(log.rows[key], key=lambda r: r[0])
            assert [r[0] for r in rows] == list(range(len(fed))), f"{key}: positions"
            assert [r[1] for r in rows] == fed, f"{key}: token ids"
            assert log.meta[key] == (spec.hook, spec.features), log.meta[key]
            pos, _, x = recorder.get(out.request_id, layer, spec.hook)
            assert pos.tolist() == list(range(len(fed))), f"{key}: captured positions"
            got = torch.from_numpy(np.stack([r[2] for r in rows]))
            f = list(spec.features)
            with torch.no_grad():
                ref, pre = sae.encode(x.float())[:, f], _pre(sae, x.float())
            scale = pre.norm(dim=1)
            # A latent on its gate (a threshold, the k-th value) may fall either way
            # under rounding: only there may the two disagree on whether it fired.
            flip = (got > 0) != (ref > 0)
            if flip.any():
                gate = sae.threshold[f] if spec.kind == "jumprelu" else None
                near = (pre[:, f] - (gate.clamp_min(0) if gate is not None else 0)).abs()
                if spec.kind == "topk":
                    kth = pre.topk(sae.cfg.k, dim=1).values[:, -1:]
                    near = (pre[:, f] - kth).abs()
                assert bool((near[flip] <= 1e-5 * scale[:, None].expand_as(near)[flip]).all())
            ok = ~flip.any(1)
            err = (got - ref)[ok].norm(dim=1) / scale[ok]
            assert float(err.max()) <= REL_TOL, f"{key}: relative error {float(err.max()):.2e}"
            fired[spec.name] += int((got > 0).sum())
            if spec.kind == "jumprelu":  # the negative thresholds gate at 0, as in SAELens
                assert bool((got >= 0).all()), float(got.min())
    assert all(fired.values()), fired
