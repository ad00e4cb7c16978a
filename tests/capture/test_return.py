"""Activations returned to the caller (``"return": true``), offline and streaming.

The rows come back through the bus (the front end's own filtered subscriber), so
they are checked like any capture: exact positions and tokens, values against HF,
under the Llama engine's preemption and prefix caching.
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from tests.support.collector import Collector
from tests.support.engine import CAPTURE_LAYERS, HOOKS
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.prompts import expected_positions, shared_prefix_prompts

pytestmark = pytest.mark.engine


def _check(acts, model_path, fed: list[int], sel: dict, prompt_len: int) -> None:
    layers = sel.get("layers", CAPTURE_LAYERS)
    hooks = sel.get("hooks", HOOKS)
    want = expected_positions(sel.get("positions", "all"), prompt_len, len(fed))
    assert acts is not None and acts.complete, sel
    assert set(acts.tensors) == {(layer, hook) for layer in layers for hook in hooks}
    assert acts.positions.tolist() == want, (sel, acts.positions.tolist())
    assert acts.token_ids.tolist() == [fed[p] for p in want]
    ref = hf_activations(model_path, fed, CAPTURE_LAYERS, HOOKS)
    for key, t in acts.tensors.items():
        assert t.shape == (len(want), ref[key].shape[1]), (key, t.shape)
        assert max_rel_error(t, ref[key][np.asarray(want)]) <= 1e-3, (sel, key)


def test_offline_outputs_carry_their_activations(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompts = shared_prefix_prompts(vocab, 7, seed=21)
    plen = len(prompts[4])
    selections = [
        {"positions": "all", "layers": [3], "hooks": ["post_block"]},
        {"positions": "generated", "hooks": ["pre_attn", "mlp_out"]},
        {"positions": "last_prompt", "tags": {"label": 1}},
        {"positions": "last", "layers": [0]},
        {"positions": [0, 5, plen + 1]},
        {},  # captured (the engine captures every request), not returned
        False,
    ]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=5 + i,
            ignore_eos=True,
            extra_args={"actbus": {**s, "return": True} if s else s},
        )
        for i, s in enumerate(selections)
    ]
    # A bus subscriber beside it sees the same rows: returning takes nothing from it.
    col = Collector(sched_engine.address)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        col.wait_ended([(o.request_id, 0) for o in outs[:-1]])
    finally:
        col.close()
    for o, sel in zip(outs, selections, strict=True):
        acts = getattr(o.outputs[0], "activations", None)
        if not sel:
            assert acts is None, "an output that did not ask got activations"
            continue
        fed = (list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[:-1]
        _check(acts, sched_engine.model_path, fed, sel, len(o.prompt_token_ids))
        key = (sel.get("layers", CAPTURE_LAYERS)[0], sel.get("hooks", HOOKS)[0])
        pos, _, rows = col.get(o.request_id, *key)
        assert pos.tolist() == acts.positions.tolist()
        assert bool((rows == acts.tensors[key]).all()), "returned rows differ from the bus'"


def test_parallel_samples_each_get_their_own_rows(sched_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sched_engine.llm
    p = shared_prefix_prompts(llm.get_tokenizer().vocab_size, 1, seed=22)[0]
    sel = {"layers": [3], "hooks": ["post_block"]}
    params = SamplingParams(
        n=3, temperature=1.0, max_tokens=7, extra_args={"actbus": {**sel, "return": True}}
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for child in out.outputs:
        fed = (list(out.prompt_token_ids) + list(child.token_ids))[:-1]
        _check(child.activations, sched_engine.model_path, fed, sel, len(p))


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_return_flag_fails_that_request_alone(sched_engine, bad):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=r"extra_args\.actbus\.return: expected true or false"):
        sched_engine.llm.generate(
            ["hello"], SamplingParams(max_tokens=2, extra_args={"actbus": {"return": bad}})
        )


@pytest.fixture(scope="module")
def async_engine(tiny_models, tmp_path_factory):
    """An ``AsyncLLM`` of its own (streaming is its job), on the tiny Llama."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    address = f"ipc://{tmp_path_factory.mktemp('bus-async')}/bus.sock"
    args = AsyncEngineArgs(
        str(tiny_models["llama"]),
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=64,  # small: it may run beside a session engine
        seed=0,
        additional_config={
            "actbus": {"publish": address, "layers": [0, 3], "requests": "selected"}
        },
    )
    engine = AsyncLLM.from_engine_args(args)
    yield engine, tiny_models["llama"]
    engine.shutdown()


def test_streamed_outputs_carry_their_rows_as_they_arrive(async_engine):
    """DELTA outputs carry the new rows of each step; CUMULATIVE ones all rows so far;
    together, and at the end, every position exactly once, matching HF."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, model_path = async_engine
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(90 + 20 * i)] for i in range(4)]
    sel = {"layers": [3], "hooks": ["post_block"], "return": True}

    async def stream(i: int, kind: RequestOutputKind, pause: float = 0.0):
        params = SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind,
            extra_args={"actbus": sel},
        )  # fmt: skip
        outs = []
        async for o in engine.generate(TokensPrompt(prompt_token_ids=prompts[i]), params, f"s{i}"):
            outs.append(o)
            await asyncio.sleep(pause)  # a slow reader: vLLM merges what it has not taken
        return outs

    async def main():
        return await asyncio.gather(
            stream(0, RequestOutputKind.DELTA),
            stream(1, RequestOutputKind.CUMULATIVE),
            stream(2, RequestOutputKind.DELTA),
            stream(3, RequestOutputKind.DELTA, pause=0.4),
        )

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - t0 < 120
    for i, outs in enumerate(results):
        # vLLM merges the outputs a reader has not taken yet, and a loaded machine makes
        # even the prompt readers lag, so only "more than one output" is certain.
        assert len(outs) > 1, "expected streamed outputs, got only the final one"
        if i == 3:
            assert len(outs) < 12, "the slow reader's outputs were not merged"
        acts = [o.outputs[0].activations for o in outs]
        assert all(a is not None for a in acts)
        assert acts[-1].complete and not any(a.complete for a in acts[:-1])
        tokens = [t for o in outs for t in o.outputs[0].token_ids] if i != 1 else None
        seen = generated = 0  # no output runs ahead of the tokens it has been fed
        for o, a in zip(outs, acts, strict=True):
            generated = len(o.outputs[0].token_ids) + (generated if i != 1 else 0)
            seen = len(a.positions) + (seen if i != 1 else 0)
            assert seen <= len(prompts[i]) + generated - 1, (i, seen, generated)
        if i == 1:  # cumulative: each output holds all rows so far, growing
            sizes = [len(a.positions) for a in acts]
            assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
            final, tokens = acts[-1], list(outs[-1].outputs[0].token_ids)
            positions, rows = final.positions, final.tensors[(3, "post_block")]
        else:  # delta: the pieces add up to every position once
            import torch

            positions = torch.cat([a.positions for a in acts])
            rows = torch.cat([a.tensors[(3, "post_block")] for a in acts])
        fed = (prompts[i] + tokens)[:-1]
        assert positions.tolist() == list(range(len(fed))), i
        ref = hf_activations(model_path, fed, [3], ["post_block"])
        assert max_rel_error(rows, ref[(3, "post_block")]) <= 1e-3
