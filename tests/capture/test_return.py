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

from tests.support.engine import CAPTURE_LAYERS, HOOKS
from tests.support.monitors import ScoreLog, max_rel, raw_expected, raw_monitor
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.prompts import expected_positions, shared_prefix_prompts
from tests.support.recorder import RowRecorder

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
    col = RowRecorder(sched_engine.address)
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
        # Streaming, not the compiled graph, is under test here (the session engines
        # capture with torch.compile on): eager starts in half the time on CPU.
        enforce_eager=True,
        additional_config={
            "actbus": {
                "publish": address,
                "layers": [0, 3],
                "requests": "selected",
                "monitor": {"monitors": async_monitors(tiny_models["llama"])},
            }
        },
    )
    engine = AsyncLLM.from_engine_args(args)
    engine.actbus_address = address
    # One event loop for every test: the engine's output handler lives on the first
    # loop that drives it, so a second asyncio.run would find it gone.
    engine.actbus_loop = asyncio.new_event_loop()
    yield engine, tiny_models["llama"]
    engine.shutdown()
    # As asyncio.run ends its loop: cancel what is left (vLLM's output handler) and let
    # it finish, so no task keeps vLLM's ZeroMQ sockets half-open in garbage, whose
    # context would block the next gc.collect() in term().
    loop = engine.actbus_loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def async_monitors(model_path) -> dict:
    """Two raw directions for the streamed score returns (tests below)."""
    return {
        "drift": raw_monitor(model_path, 11, [1, 3], bias=0.25),
        "gate": raw_monitor(model_path, 12, [2], hook="pre_attn", sigmoid=True),
    }


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
    MAX_TOKENS = 24

    async def stream(i: int, kind: RequestOutputKind, pause: float = 0.0):
        params = SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind,
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
    results = engine.actbus_loop.run_until_complete(main())
    assert time.monotonic() - t0 < 120
    # vLLM merges the outputs a reader has not taken yet, and on a loaded machine even a
    # prompt reader can lag a whole (short) generation: one stream may come as a single
    # output. Streaming is shown when the prompt readers, together, saw it.
    assert sum(len(outs) > 1 for outs in results[:3]) >= 2, [len(o) for o in results]
    assert len(results[3]) < MAX_TOKENS, "the slow reader's outputs were not merged"
    for i, outs in enumerate(results):
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
            assert sizes == sorted(sizes) and (len(sizes) == 1 or sizes[-1] > sizes[0])
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


def test_streamed_outputs_carry_their_monitor_scores(async_engine):
    """``"monitor_return": true`` on an ``AsyncLLM``: DELTA outputs carry each position's
    scores once, CUMULATIVE ones all so far, n=2 samples their own; the values are the
    bus subscriber's bitwise and match HF. A stream dropped mid-way leaves nothing
    behind in the front end."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind as K

    from actbus.monitor.returns import _COLLECTORS

    engine, model_path = async_engine
    mons = async_monitors(model_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(40 + 30 * i)] for i in range(5)]
    cases = [  # (kind, n, pause, scores back)
        (K.DELTA, 1, 0.0, True),
        (K.CUMULATIVE, 1, 0.0, True),
        (K.DELTA, 2, 0.0, True),
        (K.DELTA, 1, 0.3, True),  # a slow reader: vLLM merges what it has not taken
        (K.DELTA, 1, 0.0, False),  # monitored, scores on the bus only
    ]

    def params(kind, n, back, max_tokens=10):
        entry = {"monitor": ["drift", "gate"], "monitor_return": back}
        return SamplingParams(
            temperature=1.0 if n > 1 else 0, max_tokens=max_tokens, ignore_eos=True, n=n,
            output_kind=kind, extra_args={"actbus": entry},
        )  # fmt: skip

    async def stream(i: int):
        kind, n, pause, back = cases[i]
        outs: dict[int, list] = {}
        prompt = TokensPrompt(prompt_token_ids=prompts[i])
        gen = engine.generate(prompt, params(kind, n, back), f"m{i}")
        async for o in gen:
            for c in o.outputs:
                outs.setdefault(c.index, []).append(c)
            await asyncio.sleep(pause)
        return outs

    async def dropped():
        gen = engine.generate(
            TokensPrompt(prompt_token_ids=prompts[0]), params(K.DELTA, 1, True, 300), "gone"
        )
        k = 0
        async for _ in gen:
            k += 1
            if k == 2:
                break
        await gen.aclose()  # the caller went away: AsyncLLM aborts the request

    async def main():
        res = await asyncio.gather(*(stream(i) for i in range(len(cases))), dropped())
        return res[:-1]

    log = ScoreLog(engine.actbus_address)
    try:
        results = engine.actbus_loop.run_until_complete(main())
        keys = [(f"m{i}", s) for i, (_, n, _, _) in enumerate(cases) for s in range(n)]
        log.wait_ended(keys)
    finally:
        log.close()
    for i, outs in enumerate(results):
        kind, n, _, back = cases[i]
        assert sorted(outs) == list(range(n))
        for sample, pieces in outs.items():
            got = [c.monitor_scores if hasattr(c, "monitor_scores") else None for c in pieces]
            if not back:
                assert got == [None] * len(pieces), "scores came back unasked"
                continue
            assert all(g is not None for g in got) and len(got) > 1, (i, len(got))
            assert got[-1].complete and not any(g.complete for g in got[:-1])
            if kind == K.CUMULATIVE:
                sizes = [len(g.positions) for g in got]
                assert sizes == sorted(sizes) and (len(sizes) == 1 or sizes[-1] > sizes[0])
                tokens, final = list(pieces[-1].token_ids), got[-1]
                pos, vals = final.positions, final.values
            else:
                tokens = [t for c in pieces for t in c.token_ids]
                pos = torch.cat([g.positions for g in got])
                vals = {k: torch.cat([g.values[k] for g in got]) for k in got[-1].values}
            fed = (prompts[i] + tokens)[:-1]
            assert pos.tolist() == list(range(len(fed))), (i, sample)
            ref = hf_activations(model_path, fed, [1, 2, 3], ["post_block", "pre_attn"])
            assert set(vals) == {("drift", 1), ("drift", 3), ("gate", 2)}
            for (name, layer), v in vals.items():
                rows = sorted(log.rows[(f"m{i}", sample, name, layer)], key=lambda r: r[0])
                bus = torch.from_numpy(np.stack([r[2] for r in rows]))
                assert torch.equal(v, bus), (i, sample, name, layer)
                hook = mons[name].get("hook", "post_block")
                assert max_rel(v, raw_expected(mons[name], ref[(layer, hook)])) <= 1e-4
    deadline = time.monotonic() + 10  # the dropped stream: forgotten, not kept
    while any(c.pending() for c in _COLLECTORS.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _COLLECTORS and all(c.pending() == 0 for c in _COLLECTORS.values()), "left behind"
