"""The decoder layers of a loaded vLLM model, and what runs at each hook point.

``find_decoder_layers`` finds the model's list of decoder layers; ``wrap_layer``
wraps one layer's forward so that, at each hook point, the features' in-graph work
runs in one fixed order: steering (``actbus.steer.graph``) changes the stream, then
the tap (``actbus.capture.taps``) copies it and the monitors
(``actbus.monitor.graph``) score it, so captured rows and scores both read the
steered stream. What a layer does is read at trace time from what each feature
installed on it, so a layer no feature touches runs vLLM's forward unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from actbus import ops  # noqa: F401  (registers torch.ops.actbus.*)
from actbus.errors import ConfigError
from actbus.hooks import user_hook
from actbus.monitor.graph import monitor_point
from actbus.steer.graph import steer_point


def find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The model's decoder-layer list (``model.model.layers`` in vLLM's families)."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.endswith("layers") and len(mod) == num_layers:
            return mod
    raise ConfigError(
        f"actbus: could not find a list of {num_layers} decoder layers in "
        f"{type(model).__name__}; this architecture is not supported for capture"
    )


def owned_layers(model: nn.Module, num_layers: int, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers of ``layers`` this pipeline stage computes (others are placeholders)."""
    decoder = find_decoder_layers(model, num_layers)
    return tuple(i for i in layers if type(decoder[i]).__name__ != "PPMissingLayer")


def wrap_layer(layer: nn.Module) -> None:
    """Wrap a decoder layer's forward once; what it does is read at trace time from
    ``_actbus_taps`` (hooks to capture), ``_actbus_steer_hooks`` (points to steer,
    ``actbus.steer.graph``) and ``_actbus_monitor`` (points to score,
    ``actbus.monitor.graph``); ``_actbus_user_hooks`` (``actbus.hooks``) adds the user
    hooks' op after steering. Steering comes first at a point, so captured rows and
    monitor scores both read the steered stream."""
    if getattr(layer, "_actbus_wrapped", False):
        return
    layer._actbus_wrapped = True
    inner = layer.forward
    tap_sum, tap_copy = torch.ops.actbus.tap_sum, torch.ops.actbus.tap_copy
    stream_sum, stream_copy = torch.ops.actbus.stream_sum, torch.ops.actbus.stream_copy

    def forward(positions, hidden_states, residual=None, *args, **kwargs):
        hooks = getattr(layer, "_actbus_taps", ())
        steer = getattr(layer, "_actbus_steer_hooks", ())
        mon = getattr(layer, "_actbus_monitor", {})
        user = getattr(layer, "_actbus_user_hooks", None)  # (layer index, points)
        if "pre_attn" in steer:
            if residual is None:  # the first layer: the stream is the embeddings
                hidden_states = steer_point(layer, "pre_attn", hidden_states, hidden_states)
            else:
                residual = steer_point(layer, "pre_attn", hidden_states + residual, residual)
        if user and "pre_attn" in user[1]:  # user hooks (actbus.hooks): after steering
            user_hook(residual if residual is not None else hidden_states,
                      None if residual is None else hidden_states, user[0], "pre_attn")  # fmt: skip
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
        # Monitors read the streams rounded as capture keeps them (``stream_copy``):
        # both come out of pointwise ops inductor would fuse into the float32 read.
        if "post_attn" in mon:
            monitor_point(layer, "post_attn", stream_copy(resid))
        if "mlp_out" in hooks:
            tap_copy(layer._actbus_mlp_out, hidden)
        if "mlp_out" in mon:
            monitor_point(layer, "mlp_out", stream_copy(hidden))
        if "post_block" in steer:  # after post_attn is read: that stream is unchanged
            resid = steer_point(layer, "post_block", hidden + resid, resid)
        if user and "post_block" in user[1]:
            user_hook(resid, hidden, user[0], "post_block")
        if "post_block" in hooks:
            tap_sum(layer._actbus_post_block, hidden, resid)
        if "post_block" in mon:
            monitor_point(layer, "post_block", stream_sum(hidden, resid))
        return hidden, resid

    layer.forward = forward
