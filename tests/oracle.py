"""HF transformers' own forward pass on the same weights: the capture oracle."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_post_block(path: Path, token_ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """Residual stream leaving each layer: ``[len(token_ids), hidden]`` per layer.

    Read with forward hooks on the decoder layers so the last layer is pre-final-norm,
    and cross-checked against ``output_hidden_states`` for every other layer.
    """
    model = hf_model(str(path))
    outs: dict[int, torch.Tensor] = {}
    handles = [
        model.model.layers[layer].register_forward_hook(
            lambda _m, _i, out, layer=layer: outs.__setitem__(
                layer, (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
            )
        )
        for layer in layers
    ]
    try:
        with torch.no_grad():
            res = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    n_layers = model.config.num_hidden_layers
    for layer in layers:
        if layer < n_layers - 1:
            assert torch.equal(outs[layer], res.hidden_states[layer + 1][0]), (
                f"hook output of layer {layer} differs from hidden_states[{layer + 1}]"
            )
    return outs


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max over rows of ||got - ref|| / ||ref||: per-token relative error."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-12)
    return float(err.max())
