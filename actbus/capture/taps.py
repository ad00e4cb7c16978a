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
from actbus.streams import HOOKS, ROUTER_HOOK


@dataclass
class TapSet:
    """The buffers that the compiled graph writes each step."""

    buffers: dict[tuple[int, str], torch.Tensor]
    hidden_size: int
    dtype: torch.dtype
    max_rows: int
    device: torch.device
    experts: tuple[int, int] | None = None
    """``(num_experts, top_k)`` where the router is tapped, else None."""

    @property
    def keys(self) -> list[tuple[int, str]]:
        return list(self.buffers)

    def width(self, key: tuple[int, str]) -> int:
        """A tap's row width: the hidden size, or ``2 * top_k`` for the router."""
        return int(self.buffers[key].shape[1])

    def dtype_of(self, key: tuple[int, str]) -> torch.dtype:
        """A tap's dtype: the model's, or float32 for the router."""
        return self.buffers[key].dtype


def install_taps(
    decoder: nn.ModuleList,
    *,
    layers: tuple[int, ...],
    hooks: tuple[str, ...],
    hidden_size: int,
    max_rows: int,
    dtype: torch.dtype,
    device: torch.device,
    experts: tuple[int, int] | None = None,
) -> TapSet:
    """``experts``: ``(num_experts, top_k)`` of the model's routers, needed (and only
    allowed) with the ``router`` hook; its buffer is float32 ``[max_rows, 2 * top_k]``
    (``actbus.ops.tap_router``), which the engine's router wrapper writes."""
    buffers: dict[tuple[int, str], torch.Tensor] = {}
    if ROUTER_HOOK in hooks and experts is None:
        raise ConfigError("actbus.hooks: 'router' needs a mixture-of-experts model")
    for layer_idx in layers:
        layer = decoder[layer_idx]
        for hook in hooks:
            if hook not in HOOKS and hook != ROUTER_HOOK:
                raise ConfigError(f"actbus.hooks: hook {hook!r} is not supported")
            if hook == ROUTER_HOOK:
                shape, kind = (max_rows, 2 * experts[1]), torch.float32
            else:
                shape, kind = (max_rows, hidden_size), dtype
            buf = torch.zeros(shape, dtype=kind, device=device)
            layer.register_buffer(f"_actbus_{hook}", buf, persistent=False)
            buffers[(layer_idx, hook)] = buf
        layer._actbus_taps = tuple(h for h in HOOKS if h in hooks)
    return TapSet(
        buffers,
        hidden_size,
        dtype,
        max_rows,
        torch.device(device),
        experts if ROUTER_HOOK in hooks else None,
    )
