"""Steering in the compiled graph (inductor, dynamic shapes): exact against eager math,
and new vectors or coefficients never recompile."""

import numpy as np
import torch
from torch import nn

from actbus.capture.taps import install_taps
from actbus.engine.layers import find_decoder_layers, wrap_layer
from actbus.steer.graph import install_steering
from actbus.steer.worker import Steerer
from actbus.steps import StepRequests

D, N_LAYERS, K = 32, 3, 2


class AddNorm(nn.Module):
    """vLLM's fused add-RMSNorm: (x, residual) -> (norm(x + residual), x + residual)."""

    def forward(self, x, residual=None):
        s = x if residual is None else x + residual
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6), s


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.input_layernorm = AddNorm()
        self.post_attention_layernorm = AddNorm()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            h, _ = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        h = torch.tanh(self.attn(h))
        h, residual = self.post_attention_layernorm(h, residual)
        return torch.tanh(self.mlp(h)), residual


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer(D) for _ in range(N_LAYERS))

    def forward(self, positions, x):
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return x + residual


def reference(model, x, adds):
    """Eager forward with ``adds[(layer, hook)] = f(stream) -> delta`` applied by hand."""
    residual, h = None, x
    for i, layer in enumerate(model.model.layers):
        f = adds.get((i, "pre_attn"))
        stream = h if residual is None else h + residual
        if f is not None:
            stream = stream + f(stream)
        residual = stream
        a, _ = AddNorm()(stream)
        a = torch.tanh(layer.attn(a))
        stream = a + residual
        f = adds.get((i, "post_attn"))
        if f is not None:
            stream = stream + f(stream)
        residual = stream
        m, _ = AddNorm()(stream)
        h = torch.tanh(layer.mlp(m))
        stream = h + residual
        f = adds.get((i, "post_block"))
        if f is not None:
            stream = stream + f(stream)
        residual, h = stream, torch.zeros_like(stream)
    return h + residual


def _wire(vectors, entries):
    return {
        "steer": {
            "vectors": {d: np.asarray(v, np.float32).tobytes() for d, v in vectors.items()},
            "entries": entries,
        }
    }


def test_steering_compiles_once_and_matches_eager():
    torch.manual_seed(0)
    model = Model()
    decoder = find_decoder_layers(model, N_LAYERS)
    hooks = ("pre_attn", "post_attn", "post_block")
    tables = install_steering(
        decoder,
        layers=(0, 2),
        hooks=hooks,
        hidden_size=D,
        max_rows=64,
        per_token=K,
        max_vectors=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for i in (0, 2):
        wrap_layer(decoder[i])
    taps = install_taps(
        decoder,
        layers=(2,),
        hooks=("post_attn",),
        hidden_size=D,
        max_rows=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    steerer = Steerer(tables)
    explain = torch._dynamo.explain(model)(torch.arange(5), torch.randn(5, D))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", dynamic=True)
    torch._dynamo.utils.counters.clear()
    v = {f"d{i}": torch.randn(D) for i in range(4)}

    def run(n, rid_entries, starts, prompt_len):
        """One step of one request ``r`` with ``n`` tokens from ``starts``."""
        sr = StepRequests([("r", prompt_len, _wire(v, rid_entries))], {"r": starts}, set(), {})
        steerer.admit(sr)
        steerer.fill(["r"], np.array([0, n]), {"r": starts})
        x = torch.randn(n, D)
        with torch.inference_mode():
            got = compiled(torch.arange(n), x)
        steerer.admit(StepRequests([], {}, {"r"}, {}))
        return x, got

    # 1: a plain vector at layer 0 pre_attn (the embeddings), prompt tokens only
    x, got = run(7, [[0, "pre_attn", "d0", 2.0, 0.0, "base", "prompt"]], 0, 5)
    mask = (torch.arange(7) < 5).float()[:, None]
    want = reference(model, x, {(0, "pre_attn"): lambda s: 2.0 * mask * v["d0"]})
    torch.testing.assert_close(got, want)
    # 2: two vectors at one point, one norm-matched; post_attn and post_block of layer 2
    b = 0.5 / float(v["d2"].norm())
    entries = [
        [2, "post_attn", "d1", 1.5, 0.0, "decode", "all"],
        [2, "post_attn", "d2", 0.0, b, "base", "all"],
        [2, "post_block", "d3", -1.0, 0.0, "base", [9, 11]],
    ]
    x, got = run(13, entries, 3, 6)  # positions 3..15: decode from position 6
    pos = torch.arange(3, 16)[:, None]

    def post_attn(s):
        return (
            1.5 * (pos >= 6).float() * v["d1"]
            + 0.5 * s.norm(dim=-1, keepdim=True) * v["d2"] / v["d2"].norm()
        )

    def post_block(s):
        return -1.0 * ((pos == 9) | (pos == 11)).float() * v["d3"]

    want = reference(model, x, {(2, "post_attn"): post_attn, (2, "post_block"): post_block})
    torch.testing.assert_close(got, want)
    # 3: nothing steered: the unsteered model, the tables zeroed again
    x, got = run(40, [], 0, 40)
    torch.testing.assert_close(got, reference(model, x, {}))
    assert all(not t.any() for t in tables.coef.values())
    assert steerer.rows_in_use == 0
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"steering recompiled: {frames} graphs"
    assert taps.buffers[(2, "post_attn")].shape == (64, D)
