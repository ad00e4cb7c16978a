"""The in-graph tap survives torch.compile (inductor, dynamic shapes, no graph break)."""

import torch
from torch import nn

from actbus.capture.taps import install_taps
from actbus.engine.layers import find_decoder_layers, wrap_layer
from actbus.streams import HOOKS


class Layer(nn.Module):
    """Shaped like vLLM's decoder layers: returns (hidden_states, residual)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return torch.relu(self.lin(residual)), residual


class Model(nn.Module):
    def __init__(self, d=32, n=3):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(self, positions, x):
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return x + residual


def test_tap_is_compiled_in_place_and_exact():
    torch.manual_seed(0)
    model = Model()
    decoder = find_decoder_layers(model, 3)
    taps = install_taps(
        decoder,
        layers=(0, 2),
        hooks=HOOKS,
        hidden_size=32,
        max_rows=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for i in (0, 2):
        wrap_layer(decoder[i])
    explain = torch._dynamo.explain(model)(torch.arange(5), torch.randn(5, 32))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes]
    # per tapped layer: pre_attn (a copy on layer 0, a sum later), post_attn, mlp_out, post_block
    assert ops.count("actbus.tap_sum") == 3 and ops.count("actbus.tap_copy") == 5, ops
    compiled = torch.compile(model, backend="inductor", dynamic=True)
    ptrs = {k: b.data_ptr() for k, b in taps.buffers.items()}
    for n in (7, 13, 40):
        x = torch.randn(n, 32)
        with torch.inference_mode():
            compiled(torch.arange(n), x)
            residual, h = None, x
            for i, layer in enumerate(model.model.layers):
                stream_in = h if residual is None else h + residual
                h, residual = layer(None, h, residual)
                if i not in (0, 2):
                    continue
                want = {
                    "pre_attn": stream_in,
                    "post_attn": residual,
                    "mlp_out": h,
                    "post_block": h + residual,
                }
                for hook, ref in want.items():
                    torch.testing.assert_close(taps.buffers[(i, hook)][:n], ref, msg=hook)
    assert ptrs == {k: b.data_ptr() for k, b in taps.buffers.items()}, "buffers must stay put"
