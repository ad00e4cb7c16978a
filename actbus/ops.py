"""The in-graph tap: a registered custom op that torch.compile and CUDA graphs keep.

Forward hooks force eager execution; this op is traced into the compiled graph
instead. It writes into a persistent, preallocated buffer (a module buffer, so the
compiled graph takes it as an input at a fixed address and a CUDA graph replays
the write). Because the op declares that it mutates ``out``, the compiler neither
removes it nor reorders it past later uses of ``out``.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("actbus::tap_sum", mutates_args=("out",))
def tap_sum(out: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """``out[:n] = hidden + residual``: the residual stream as vLLM keeps it split."""
    torch.add(hidden, residual, out=out[: hidden.shape[0]])


@tap_sum.register_fake
def _tap_sum_fake(out: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor) -> None:
    return None


@torch.library.custom_op("actbus::tap_copy", mutates_args=("out",))
def tap_copy(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out[:n] = x``: for hook points where the stream is one tensor."""
    out[: x.shape[0]].copy_(x)


@tap_copy.register_fake
def _tap_copy_fake(out: torch.Tensor, x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("actbus::stream_sum", mutates_args=())
def stream_sum(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``hidden + residual`` in their own dtype, as a tensor of its own.

    For what reads the summed stream in the graph (monitors): inductor fuses a bf16
    sum into the float32 read that follows and skips rounding the sum to bf16, so a
    monitor would score a stream neither capture (``tap_sum`` rounds) nor HF
    transformers has. An op the compiler cannot see into keeps the rounding."""
    return hidden + residual


@stream_sum.register_fake
def _stream_sum_fake(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden)


@torch.library.custom_op("actbus::stream_copy", mutates_args=())
def stream_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its own dtype, as a tensor of its own.

    ``stream_sum``'s reason, for a stream the layer computed as one tensor: vLLM's
    post-attention residual is a sum made inside the fused add-and-norm (or by
    steering), and a family's ``mlp_out`` may be a norm's output; inductor fuses those
    pointwise ops into a monitor's float32 read and skips their bf16 rounding, so the
    monitor scored a stream capture never had (1e-2 of the SAE's pre-activations
    apart, measured). An op the compiler cannot see into keeps the rounding."""
    return x.clone()


@stream_copy.register_fake
def _stream_copy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("actbus::tap_router", mutates_args=("out",))
def tap_router(out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, scale: float) -> None:
    """``out[:n] = [ids, weights * scale]`` in float32: a router's top-k choice per token
    (expert ids are small integers, exact in float32), read where the router returns
    it (``actbus.engine.moe``). ``scale``: a routed scaling factor the MoE block applies
    to the experts' output rather than to the weights, so the row holds the weight each
    expert's output is multiplied by."""
    n, k = ids.shape[0], ids.shape[1]
    out[:n, :k].copy_(ids)
    out[:n, k : 2 * k].copy_(weights * scale)


@tap_router.register_fake
def _tap_router_fake(
    out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, scale: float
) -> None:
    return None
