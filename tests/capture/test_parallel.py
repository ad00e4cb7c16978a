"""Tensor and pipeline parallelism: one engine with TP=2 x PP=2 on CPU.

Each pipeline stage captures the layers it owns (stage 0: layers 0-1, stage 1:
layers 2-3), only tensor-parallel rank 0 of a stage captures, and the second stage
forwards its messages to the first stage's publisher. Subscribers see one stream:
every layer, every position exactly once, the same step numbers on both stages.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict

import numpy as np
import pytest

from actbus.bus import Batch, Subscription
from tests.support.collector import Collector
from tests.support.oracle import hf_activations, max_rel_error

pytestmark = pytest.mark.engine
LAYERS = [0, 1, 2, 3]
HOOKS = ["pre_attn", "post_block"]


@pytest.fixture(scope="module")
def parallel_engine(tiny_models, tmp_path_factory):
    from vllm import LLM

    address = f"ipc://{tmp_path_factory.mktemp('bus-parallel')}/bus.sock"
    # Four workers on two cores: vLLM's CPU backend binds each to a core list.
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1|0|1"
    try:
        llm = LLM(
            str(tiny_models["llama"]),
            dtype="float32",
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            gpu_memory_utilization=0.3,
            max_model_len=512,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            num_gpu_blocks_override=64,
            seed=0,
            additional_config={"actbus": {"publish": address, "layers": LAYERS, "hooks": HOOKS}},
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    yield llm, address, tiny_models["llama"]
    llm.llm_engine.engine_core.shutdown()


class _StepLog(Collector):
    """A collector that also keeps, per step, which rows each layer carried."""

    def __init__(self, address: str) -> None:
        self.steps: dict[int, dict[tuple[int, str], list]] = defaultdict(dict)
        super().__init__(address, Subscription(window=1024))

    def _keep(self, b: Batch) -> None:
        rows = b.header.rows
        self.steps[b.step][(b.layer, b.hook)] = list(
            zip(rows.row_request_ids(), rows.positions.tolist(), strict=True)
        )
        super()._keep(b)


def test_every_stage_publishes_its_layers_into_one_stream(parallel_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, address, model_path = parallel_engine
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(10 + 37 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(
        temperature=0, max_tokens=9, ignore_eos=True,
        extra_args={"actbus": {"layers": [1, 3], "hooks": ["post_block"], "return": True}},
    )  # fmt: skip
    col = _StepLog(address)
    try:
        assert col.sub.welcome["layers"] == LAYERS
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        # Each stage's messages carry the request ends; wait for every layer's rows.
        want = {}
        for o, sp in zip(outs, params, strict=True):
            sel = (sp.extra_args or {}).get("actbus") or {}
            n = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
            for layer in sel.get("layers", LAYERS):
                for hook in sel.get("hooks", HOOKS):
                    want[(o.request_id, 0, layer, hook)] = n
        col.wait(lambda c: all(len(c.rows[k].positions) >= n for k, n in want.items()), 60)
        col.wait_ended([(o.request_id, 0) for o in outs])
    finally:
        col.close()
    for o, sp in zip(outs, params, strict=True):
        sel = (sp.extra_args or {}).get("actbus") or {}
        fed = (list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[:-1]
        ref = hf_activations(model_path, fed, LAYERS, HOOKS)
        for layer in sel.get("layers", LAYERS):
            for hook in sel.get("hooks", HOOKS):
                pos, tok, acts = col.get(o.request_id, layer, hook)
                assert pos.tolist() == list(range(len(fed))), (o.request_id, layer, hook)
                assert tok.tolist() == fed
                assert max_rel_error(acts, ref[(layer, hook)]) <= 1e-3, (layer, hook)
        acts_back = getattr(o.outputs[0], "activations", None)
        if sel.get("return"):
            assert acts_back is not None and acts_back.complete
            for key in [(1, "post_block"), (3, "post_block")]:  # one from each stage
                assert (acts_back[key] == col.get(o.request_id, *key)[2]).all()
        else:
            assert acts_back is None
    # One stream: in every step, the layers of both stages carry the same rows.
    mixed = 0
    for step, per_tap in col.steps.items():
        full = [rows for (layer, hook), rows in per_tap.items() if hook == "pre_attn"]
        assert all(rows == full[0] for rows in full), f"step {step}: stages disagree"
        mixed += len({layer for layer, _ in per_tap}) == len(LAYERS)
    assert mixed > 0, "no step carried layers of both stages"
    assert np.all(np.diff(sorted(col.steps)) > 0)
