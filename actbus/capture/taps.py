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
from actbus.capture.archs import SUPPORTED_ARCHITECTURES, check_architecture
from actbus.errors import ConfigError
from actbus.monitor.graph import monitor_point
from actbus.steer.graph import steer_point
from actbus.streams import HOOKS

__all__ = ["SUPPORTED_ARCHITECTURES", "TapSet", "check_architecture", "install_taps"]


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
            if hook not in HOOKS:
                raise ConfigError(f"actbus.hooks: hook {hook!r} is not supported")
            buf = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            layer.register_buffer(f"_actbus_{hook}", buf, persistent=False)
            buffers[(layer_idx, hook)] = buf
        layer._actbus_taps = tuple(h for h in HOOKS if h in hooks)
        wrap_layer(layer)
    return TapSet(buffers, hidden_size, dtype, max_rows, torch.device(device))


def owned_layers(model: nn.Module, num_layers: int, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers of ``layers`` this pipeline stage computes (others are placeholders)."""
    decoder = find_decoder_layers(model, num_layers)
    return tuple(i for i in layers if type(decoder[i]).__name__ != "PPMissingLayer")


def wrap_layer(layer: nn.Module) -> None:
    """Wrap a decoder layer's forward once; what it does is read at trace time from
    ``_actbus_taps`` (hooks to capture), ``_actbus_steer_hooks`` (points to steer,
    ``actbus.steer.graph``) and ``_actbus_monitor`` (points to score,
    ``actbus.monitor.graph``). Steering comes first at a point, so captured rows and
    monitor scores both read the steered stream."""
    if getattr(layer, "_actbus_wrapped", False):
        return
    layer._actbus_wrapped = True
    inner = layer.forward
    tap_sum, tap_copy = torch.ops.actbus.tap_sum, torch.ops.actbus.tap_copy
    stream_sum = torch.ops.actbus.stream_sum

    def forward(positions, hidden_states, residual=None, *args, **kwargs):
        hooks = getattr(layer, "_actbus_taps", ())
        steer = getattr(layer, "_actbus_steer_hooks", ())
        mon = getattr(layer, "_actbus_monitor", {})
        if "pre_attn" in steer:
            if residual is None:  # the first layer: the stream is the embeddings
                hidden_states = steer_point(layer, "pre_attn", hidden_states, hidden_states)
            else:
                residual = steer_point(layer, "pre_attn", hidden_states + residual, residual)
        if "pre_attn" in hooks:
            if residual is None:
                tap_copy(layer._actbus_pre_attn, hidden_states)
            else:
                tap_sum(layer._actbus_pre_attn, hidden_states, residual)
        if "pre_attn" in mon:  # the sum rounded as capture rounds it (``stream_sum``)
            monitor_point(
                layer,
                "pre_attn",
                hidden_states if residual is None else stream_sum(hidden_states, residual),
            )
        hidden, resid = inner(positions, hidden_states, residual, *args, **kwargs)
        if "post_attn" in hooks:
            tap_copy(layer._actbus_post_attn, resid)
        if "post_attn" in mon:
            monitor_point(layer, "post_attn", resid)
        if "mlp_out" in hooks:
            tap_copy(layer._actbus_mlp_out, hidden)
        if "mlp_out" in mon:
            monitor_point(layer, "mlp_out", hidden)
        if "post_block" in steer:  # after post_attn is read: that stream is unchanged
            resid = steer_point(layer, "post_block", hidden + resid, resid)
        if "post_block" in hooks:
            tap_sum(layer._actbus_post_block, hidden, resid)
        if "post_block" in mon:
            monitor_point(layer, "post_block", stream_sum(hidden, resid))
        return hidden, resid

    layer.forward = forward
