"""The decoder layers of a loaded vLLM model, and what runs at each hook point.

``find_decoder_layers`` finds the model's list of decoder layers (by structure:
``actbus.engine.anatomy``, which also reads each layer's form); ``wrap_layer``
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
from actbus.engine.anatomy import RESIDUAL, LayerForm, find_layers
from actbus.hooks import user_hook
from actbus.monitor.graph import monitor_point
from actbus.steer.graph import steer_point


def find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The model's decoder-layer list (``model.model.layers`` in vLLM's own families,
    ``language_model.model.layers`` in a multimodal wrapper); the engine reads their
    form with ``actbus.engine.anatomy.anatomy``."""
    return find_layers(model, num_layers)[1]


def wrap_layer(layer: nn.Module, form: LayerForm = RESIDUAL) -> None:
    """Wrap a decoder layer's forward once; what it does is read at trace time from
    ``_actbus_taps`` (hooks to capture), ``_actbus_steer_hooks`` (points to steer,
    ``actbus.steer.graph``) and ``_actbus_monitor`` (points to score,
    ``actbus.monitor.graph``); ``_actbus_user_hooks`` (``actbus.hooks``) adds the user
    hooks' op after steering. Steering comes first at a point, so captured rows and
    monitor scores both read the steered stream. ``form``: the layer's, as
    ``actbus.engine.anatomy`` read it."""
    if getattr(layer, "_actbus_wrapped", False):
        return
    layer._actbus_wrapped = True
    inner = layer.forward
    if form.adapter is None and form.stream_first:  # gpt-oss's order of the same form

        def forward(hidden_states, positions, residual=None, *args, **kwargs):
            def run(h, r):
                return inner(h, positions, r, *args, **kwargs)

            return _points(layer, run, hidden_states, residual)

    elif form.adapter is None:  # the residual form: the points are the layer's own in and out

        def forward(positions, hidden_states, residual=None, *args, **kwargs):
            def run(h, r):
                return inner(positions, h, r, *args, **kwargs)

            return _points(layer, run, hidden_states, residual)

    else:  # the stream in, the stream out: the adapter splits the layer's work
        adapter, at = form.adapter, form.stream_arg

        def forward(*args, **kwargs):
            args = list(args)
            stream = args[at] if len(args) > at else kwargs.pop("hidden_states")
            batched = stream.dim() == 3  # HF's layers (Transformers backend): [1, tokens, hidden]
            if batched:
                stream = stream[0]

            def run(h, _r):
                return adapter(layer, inner, args[:at] + args[at + 1 :], kwargs, h)

            hidden, resid = _points(layer, run, stream, None)
            out = hidden + resid
            return out[None] if batched else out

    layer.forward = forward


def _points(layer: nn.Module, run, hidden_states, residual):
    """Steering, taps and monitors around ``run(hidden_states, residual) -> (what the MLP
    block adds, the stream after attention)``: the residual form's in and out."""
    tap_sum, tap_copy = torch.ops.actbus.tap_sum, torch.ops.actbus.tap_copy
    stream_sum, stream_copy = torch.ops.actbus.stream_sum, torch.ops.actbus.stream_copy
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
    hidden, resid = run(hidden_states, residual)
    if "post_attn" in hooks:
        tap_copy(layer._actbus_post_attn, resid)
    # Monitors read the streams rounded as capture keeps them (``stream_copy``): both
    # come out of pointwise ops inductor would fuse into the float32 read.
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
