"""``replace``, ``ablate`` and ``clamp`` in the compiled graph (AOT autograd, dynamic shapes):
exact against eager math, composable at one point, and new rows, directions and SAE
latents never recompile. The engine-level checks against HF are in
``test_steer_ops_engine.py``."""

import numpy as np
import torch

from actbus.engine.layers import find_decoder_layers, wrap_layer
from actbus.steer.graph import install_steering
from actbus.steer.worker import Steerer
from actbus.steps import StepRequests
from tests.steer.test_steer_graph import N_LAYERS, D, Model, reference

K = 4
NONE = None  # no gate


def _wire(vectors, entries):
    return {
        "steer": {
            "vectors": {
                d: np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in v]).tobytes()
                if isinstance(v, tuple)
                else np.asarray(v, np.float32).tobytes()
                for d, v in vectors.items()
            },
            "entries": entries,
        }
    }


def test_ops_compile_once_and_match_eager():
    torch.manual_seed(0)
    model = Model()
    decoder = find_decoder_layers(model, N_LAYERS)
    tables = install_steering(
        decoder,
        layers=(0, 1, 2),
        hooks=("pre_attn", "post_attn", "post_block"),
        hidden_size=D,
        max_rows=64,
        per_token=K,
        max_vectors=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
        ops=("add", "replace", "ablate", "clamp"),
    )
    for i in range(N_LAYERS):
        wrap_layer(decoder[i])
    steerer = Steerer(tables)
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="aot_eager", dynamic=True
    )  # (inductor: the engine tests)
    torch._dynamo.utils.counters.clear()

    def run(n, vectors, entries, start, prompt_len):
        sr = StepRequests([("r", prompt_len, _wire(vectors, entries))], {"r": start}, set(), {})
        steerer.admit(sr)
        steerer.fill(["r"], np.array([0, n]), {"r": start})
        x = torch.randn(n, D)
        with torch.inference_mode():
            got = compiled(torch.arange(n), x)
        steerer.admit(StepRequests([], {}, {"r"}, {}))
        return x, got

    def unit(v):
        return v / v.norm()

    def check(seed):
        g = torch.Generator().manual_seed(seed)
        row_a, row_b, add = (torch.randn(D, generator=g) for _ in range(3))
        u1 = unit(torch.randn(D, generator=g))
        u2 = unit(torch.randn(D, generator=g))
        u2 = unit(u2 - (u2 @ u1) * u1)
        enc, dec = torch.randn(D, generator=g), torch.randn(D, generator=g)
        bias, thr, value = 0.3, 0.5 * seed, 2.0 + seed
        vectors = {"ra": row_a, "rb": row_b, "add": add, "u1": (u1, u1), "u2": (u2, u2)}
        vectors["sae"] = (dec, enc)
        replace = (0.0, 0.0, 0.0, 0.0, 1.0)
        ablate = (-1.0, 0.0, 0.0, 0.0, 0.0)
        clamp = (0.0, -1.0, bias, thr, 0.0)
        entries = [
            # replace rows at two positions of layer 0's input (the embeddings)
            [0, "pre_attn", "ra", 1.0, 0.0, "base", [1], NONE, replace],
            [0, "pre_attn", "rb", 1.0, 0.0, "base", [4], NONE, replace],
            # ablate two directions at layer 1 post_attn, prompt tokens, plus an add there
            [1, "post_attn", "u1", 0.0, 0.0, "prefill", "all", NONE, ablate],
            [1, "post_attn", "u2", 0.0, 0.0, "prefill", "all", NONE, ablate],
            [1, "post_attn", "add", 0.5, 0.0, "base", "all"],
            # clamp a latent at layer 2's output, generated tokens
            [2, "post_block", "sae", value, 0.0, "base", "generated", NONE, clamp],
        ]
        n, prompt_len = 9, 6
        x, got = run(n, vectors, entries, 0, prompt_len)
        pos = torch.arange(n)[:, None]

        def pre0(s):
            rows = torch.where(pos == 1, row_a, torch.where(pos == 4, row_b, s))
            return rows - s

        def post_attn1(s):
            prompt = (pos < prompt_len).float()
            proj = (s @ u1)[:, None] * u1 + (s @ u2)[:, None] * u2
            return -prompt * proj + 0.5 * add

        def post_block2(s):
            pre = s @ enc + bias
            f = pre * (pre > thr)
            return (pos >= prompt_len).float() * (value - f)[:, None] * dec

        want = reference(
            model,
            x,
            {(0, "pre_attn"): pre0, (1, "post_attn"): post_attn1, (2, "post_block"): post_block2},
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    for seed in range(2):  # new values the second time: no recompile
        check(seed)
    # nothing steered: the unsteered model, bit for bit, and the tables zeroed
    x, got = run(12, {}, [], 0, 12)
    with torch.inference_mode():
        assert torch.equal(got, compiled(torch.arange(12), x))
    torch.testing.assert_close(got, reference(model, x, {}))
    assert all(not t.any() for t in tables.coef.values())
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"the operations recompiled: {frames} graphs"
