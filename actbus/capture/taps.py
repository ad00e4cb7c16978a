"""Installing in-graph taps on a loaded vLLM model.

Each (layer, hook) gets a persistent buffer of ``max_rows x hidden`` registered on
the decoder layer, and the layer's forward is wrapped so the traced graph calls
the tap op on the layer's outputs. This happens after weights load and before the
first forward, which is when vLLM compiles and captures graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from actbus.capture import ops  # noqa: F401  (registers torch.ops.actbus.*)
from actbus.config import ConfigError

# Architectures whose vLLM decoder layers return ``(hidden_states, residual)`` with
# the residual stream equal to their sum: what the post_block tap reads.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def check_architecture(architectures: list[str] | None) -> str:
    """The supported architecture of a model, or a ConfigError naming it."""
    archs = list(architectures or [])
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    raise ConfigError(
        f"actbus: architecture {archs or '(unknown)'} is not supported for capture; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


@dataclass
class TapSet:
    """The buffers that the compiled graph writes each step."""

    buffers: dict[tuple[int, str], torch.Tensor]
    hidden_size: int
    dtype: torch.dtype
    max_rows: int

    @property
    def keys(self) -> list[tuple[int, str]]:
        return list(self.buffers)


def find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The model's decoder-layer list (``model.model.layers`` in vLLM's families)."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.endswith("layers") and len(mod) == num_layers:
            return mod
    raise ConfigError(
        f"actbus: could not find a list of {num_layers} decoder layers in "
        f"{type(model).__name__}; this architecture is not supported for capture"
    )


def install_taps(
    model: nn.Module,
    *,
    layers: tuple[int, ...],
    hooks: tuple[str, ...],
    num_layers: int,
    hidden_size: int,
    max_rows: int,
    dtype: torch.dtype,
    device: torch.device,
) -> TapSet:
    decoder = find_decoder_layers(model, num_layers)
    buffers: dict[tuple[int, str], torch.Tensor] = {}
    for layer_idx in layers:
        layer = decoder[layer_idx]
        for hook in hooks:
            if hook != "post_block":
                raise ConfigError(f"actbus.hooks: hook {hook!r} is not supported")
            buf = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            layer.register_buffer("_actbus_post_block", buf, persistent=False)
            _wrap_post_block(layer)
            buffers[(layer_idx, hook)] = buf
    return TapSet(buffers=buffers, hidden_size=hidden_size, dtype=dtype, max_rows=max_rows)


def _wrap_post_block(layer: nn.Module) -> None:
    inner = layer.forward

    def forward(*args, **kwargs):
        hidden, residual = inner(*args, **kwargs)
        torch.ops.actbus.tap_sum(layer._actbus_post_block, hidden, residual)
        return hidden, residual

    layer.forward = forward
