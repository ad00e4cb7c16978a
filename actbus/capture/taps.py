"""Installing in-graph taps on a loaded model's decoder layers.

Each (layer, hook) gets a persistent buffer of ``max_rows x hidden`` registered on
the decoder layer, and the layer's ``_actbus_taps`` names its hooks; the engine
wraps the layer's forward (``actbus.engine.layers.wrap_layer``) so the traced graph
calls the tap op there. This happens after weights load and before the first
forward, which is when vLLM compiles and captures graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from actbus import ops  # noqa: F401  (registers torch.ops.actbus.*)
from actbus.errors import ConfigError
from actbus.streams import HOOKS


@dataclass
class TapSet:
    """The buffers that the compiled graph writes each step."""

    buffers: dict[tuple[int, str], torch.Tensor]
    hidden_size: int
    dtype: torch.dtype
    max_rows: int
    device: torch.device

    @property
    def keys(self) -> list[tuple[int, str]]:
        return list(self.buffers)


def install_taps(
    decoder: nn.ModuleList,
    *,
    layers: tuple[int, ...],
    hooks: tuple[str, ...],
    hidden_size: int,
    max_rows: int,
    dtype: torch.dtype,
    device: torch.device,
) -> TapSet:
    buffers: dict[tuple[int, str], torch.Tensor] = {}
    for layer_idx in layers:
        layer = decoder[layer_idx]
        for hook in hooks:
            if hook not in HOOKS:
                raise ConfigError(f"actbus.hooks: hook {hook!r} is not supported")
            buf = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            layer.register_buffer(f"_actbus_{hook}", buf, persistent=False)
            buffers[(layer_idx, hook)] = buf
        layer._actbus_taps = tuple(h for h in HOOKS if h in hooks)
    return TapSet(buffers, hidden_size, dtype, max_rows, torch.device(device))
