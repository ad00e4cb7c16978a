"""The routers of a mixture-of-experts model, and the ``router`` tap on them.

vLLM's MoE blocks route through a router object (``FusedMoERouter``) held by the
block's expert runner; its ``_compute_routing`` returns ``(topk_weights, topk_ids)``
exactly as that family routes (softmax or sigmoid, top-k, renormalised or not,
DeepSeek's grouped top-k and correction bias), before any expert-parallel remapping.
The tap wraps that method on the instance: the custom op ``actbus::tap_router``
copies both into the layer's ``_actbus_router`` buffer, inside the graph Dynamo
traces (CPU) or inside vLLM's own MoE op (where routing runs there), so neither
graph breaks nor CUDA graphs are lost.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from actbus import ops  # noqa: F401  (registers torch.ops.actbus.*)
from actbus.errors import ConfigError


def layer_router(layer: nn.Module) -> tuple[Any, Any] | None:
    """``(runner, router)`` of a decoder layer's MoE block, or None (a dense layer)."""
    for mod in layer.modules():
        router = getattr(mod, "router", None)
        if callable(getattr(router, "_compute_routing", None)) and hasattr(router, "top_k"):
            return mod, router
    return None


def model_experts(decoder: nn.ModuleList, layers: tuple[int, ...], arch: str) -> tuple[int, int]:
    """``(num_experts, top_k)`` shared by ``layers``' routers; a layer with no router
    (dense), or one whose kernel routes inside itself, is refused by name."""
    seen: set[tuple[int, int]] = set()
    for i in layers:
        found = layer_router(decoder[i])
        if found is None:
            raise ConfigError(
                f"actbus.hooks: 'router' is not a hook of layer {i} of {arch}: it has no "
                "mixture-of-experts router (a dense layer); drop 'router' from actbus.hooks "
                "or tap only the model's MoE layers (actbus.layers)"
            )
        runner, router = found
        if getattr(runner, "is_monolithic", False):
            raise ConfigError(
                f"actbus.hooks: 'router' cannot be read on layer {i} of {arch}: its MoE "
                "kernel routes inside itself (a monolithic kernel), so no router runs for "
                "actbus to tap; drop 'router' from actbus.hooks"
            )
        seen.add((int(router.global_num_experts), int(router.top_k)))
    if len(seen) != 1:
        raise ConfigError(f"actbus.hooks: 'router': layers of {arch} route differently: {seen}")
    return seen.pop()


def wrap_router(layer: nn.Module) -> None:
    """Make the layer's router also write its choice into ``layer._actbus_router``."""
    runner, router = layer_router(layer) or (None, None)
    if router is None or getattr(router, "_actbus_wrapped", False):
        return
    router._actbus_wrapped = True
    inner = router._compute_routing
    # A block that scales the experts' output instead of the weights (DeepSeek): the
    # row holds the weight each expert's output is multiplied by, as HF's router gives.
    scale = float(getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
    tap = torch.ops.actbus.tap_router

    def compute_routing(hidden_states, router_logits, indices_type, **kwargs):
        weights, ids = inner(hidden_states, router_logits, indices_type, **kwargs)
        tap(layer._actbus_router, weights, ids, scale)
        return weights, ids

    router._compute_routing = compute_routing
