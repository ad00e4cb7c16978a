"""Tensor and pipeline parallelism: one engine with TP=2 x PP=2 on CPU.

Steering too: every tensor-parallel rank adds the same vector, each stage at the
layers it owns.

Each pipeline stage captures the layers it owns (stage 0: layers 0-1, stage 1:
layers 2-3), only tensor-parallel rank 0 of a stage captures, and the second stage
forwards its messages to the first stage's publisher. Subscribers see one stream:
every layer, every position exactly once, the same step numbers on both stages.
"""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from actbus.bus import Batch, Subscription
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.recorder import RowRecorder
from tests.support.steer_oracle import HFSteer, hf_steered_greedy

pytestmark = pytest.mark.engine
LAYERS = [0, 1, 2, 3]
HOOKS = ["pre_attn", "post_block"]
GATE = "gate"
GATE_POINT = {"layers": [2], "hook": "pre_attn"}


@pytest.fixture(scope="module")
def parallel_engine(tiny_models, tmp_path_factory):
    from vllm import LLM

    sock_dir = tmp_path_factory.mktemp("bus-parallel")
    address = f"ipc://{sock_dir}/bus.sock"
    hidden = json.loads((tiny_models["llama"] / "config.json").read_text())["hidden_size"]
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
            # Stages, ranks and one stream are under test here, not Inductor's kernels
            # (the Llama engine of tests/support/engine.py compiles with Inductor): the
            # graph is traced by Dynamo as vLLM CPU always traces it, taps and steering
            # in it, and run without Inductor's code generation, which took most of four
            # workers' start on two cores. This is what VLLM_CPU_CI_ENV picks (DYNAMO_ONLY),
            # set here as the config so the workers still run vLLM's warm-up, which
            # pipeline parallelism needs (its later stages allocate their tensors there).
            compilation_config={"mode": 2, "backend": "eager"},  # DYNAMO_TRACE_ONCE
            additional_config={
                "actbus": {
                    "publish": address,
                    "layers": LAYERS,
                    "hooks": HOOKS,
                    "steer": {"hooks": ["pre_attn", "post_attn", "post_block"]},
                    # A gate's monitor on stage 1, whose weights the tests push.
                    "monitor": {"monitors": {GATE: {**GATE_POINT, "weight": [0.0] * hidden}}},
                    "control": f"ipc://{sock_dir}/control.sock",
                }
            },
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    llm.actbus_control = f"ipc://{sock_dir}/control.sock"
    yield llm, address, tiny_models["llama"]
    llm.llm_engine.engine_core.shutdown()


class _StepLog(RowRecorder):
    """A recorder that also keeps, per step, which rows each layer carried."""

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


def test_steering_on_both_stages_matches_hf(parallel_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, _, model_path = parallel_engine
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(12 + 29 * i)] for i in range(3)]
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    g = torch.Generator().manual_seed(2)
    norm = float(
        hf_activations(model_path, prompts[0], [1], ["pre_attn"])[(1, "pre_attn")]
        .norm(dim=-1)
        .mean()
    )
    v = [2 * norm * u / u.norm() for u in torch.randn(3, hidden, generator=g)]
    cases = [
        [HFSteer(0, "post_attn", v[0]), HFSteer(3, "pre_attn", v[1], 0.7, True)],
        [
            HFSteer(2, "post_block", v[2], tier="decode"),
            HFSteer(1, "post_block", v[0], tier="prefill"),
        ],
        [],
    ]

    def entry(s: HFSteer) -> dict:
        return {"vector": s.vector.tolist(), "layers": s.layer, "hooks": s.hook, "scale": s.scale,
                "norm_match": s.norm_match, "tier": s.tier}  # fmt: skip

    params = [
        SamplingParams(
            temperature=0,
            max_tokens=6,
            ignore_eos=True,
            extra_args={"actbus": {"steer": [entry(s) for s in c], "return": True}},
        )
        for c in cases
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    changed = 0
    for o, steers in zip(outs, cases, strict=True):
        tokens, want = hf_steered_greedy(model_path, list(o.prompt_token_ids), 6, steers, LAYERS)
        assert list(o.outputs[0].token_ids) == tokens, steers
        acts = o.outputs[0].activations
        assert acts is not None and acts.complete
        for key in acts.tensors:
            assert max_rel_error(acts[key], want[key]) <= 1e-3, (key, steers)
        changed += (
            bool(steers)
            and tokens != hf_steered_greedy(model_path, list(o.prompt_token_ids), 6, [], [])[0]
        )
    assert changed >= 1, "steering this strong should change some greedy tokens"


def test_pushed_gate_weights_reach_every_tensor_parallel_rank(parallel_engine):
    """A gate's monitor lives on both tensor-parallel ranks of stage 1, and each rank's
    gate reads its own copy: a push must reach both, or the ranks' streams part and the
    output matches neither oracle. Pushing ``score = +10`` opens the gate (HF steered),
    ``-10`` closes it (HF unsteered), tokens and captured rows alike."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.bus.control import ControlClient
    from tests.support.steer_oracle import HFGate

    llm, _, model_path = parallel_engine
    prompt = [random.Random(9).randrange(3, 500) for _ in range(14)]
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    norm = float(
        hf_activations(model_path, prompt, [2], ["pre_attn"])[(2, "pre_attn")].norm(dim=-1).mean()
    )
    u = torch.randn(hidden, generator=torch.Generator().manual_seed(4))
    v = 2 * norm * u / u.norm()
    gate = {"monitor": GATE, "threshold": 0.0, "source": "token"}
    params = SamplingParams(
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        extra_args={
            "actbus": {
                "steer": [{"vector": v.tolist(), "layers": 2, "hooks": "post_attn", "gate": gate}],
                "return": True,
            }
        },
    )
    seen = []
    with ControlClient(llm.actbus_control, timeout_s=30) as c:
        for bias in (10.0, -10.0):
            version = c.push(GATE, np.zeros(hidden, np.float32), [bias])["version"]
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            hf_gate = HFGate((2, "pre_attn"), lambda x, b=bias: torch.full((x.shape[0],), b), 0.0)
            steers = [HFSteer(2, "post_attn", v, gate=hf_gate)]
            tokens, want = hf_steered_greedy(model_path, prompt, 6, steers, LAYERS)
            assert list(out.outputs[0].token_ids) == tokens, bias
            acts = out.outputs[0].activations
            assert acts is not None and acts.complete
            for key in acts.tensors:
                assert max_rel_error(acts[key], want[key]) <= 1e-3, (key, bias)
            seen.append(tokens)
            assert c.status()["monitors"][GATE]["in_use"] == version
    assert seen[0] != seen[1], "the open gate's steering should change the greedy tokens"
