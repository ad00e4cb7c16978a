"""What the compiled forward computes to steer: a gather from persistent tables.

Every steerable point (layer, hook) owns two buffers of ``max_rows`` rows, filled by
the worker before each forward: for each token, ``K`` indices into one shared table
of vectors, and per index two coefficients ``(a, b)``. The point adds

    delta[t] = sum_k (a[t, k] + b[t, k] * ||stream[t]||) * table[index[t, k]]

to the residual stream (``a = scale`` for a plain vector, ``b = scale / ||v||`` for
a norm-matched one). Row 0 of the table is zeros and unused slots have zero
coefficients, so a token nobody steers gets exactly ``+ 0``: its stream is bitwise
what it would be without steering. The buffers are module buffers at fixed
addresses: the compiled graph reads them as inputs and a CUDA graph replays the
reads, so new vectors and new coefficients never recompile or recapture anything.

vLLM keeps the stream split as ``(hidden_states, residual)``; the vector goes into
``residual`` (or, entering the first layer, into the embeddings), so everything
downstream sees it. ``post_attn`` is inside the layer, between attention and the
MLP: the norm that adds attention's output to the residual is wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# The norm of each family's decoder layer that takes (attention output, residual) and
# returns (normed MLP input, residual after attention): vLLM's fused add-RMSNorm.
POST_ATTN_NORM = {
    "Gemma2ForCausalLM": "pre_feedforward_layernorm",
    "Gemma3ForCausalLM": "pre_feedforward_layernorm",
}
DEFAULT_POST_ATTN_NORM = "post_attention_layernorm"


@dataclass
class SteerTables:
    """The device tables of one model (this pipeline stage's steerable layers)."""

    table: torch.Tensor  # [max_vectors, hidden], row 0 zeros
    index: dict[tuple[int, str], torch.Tensor]  # [max_rows, K] int64
    coef: dict[tuple[int, str], torch.Tensor]  # [max_rows, K, 2] float32
    per_token: int
    max_rows: int

    @property
    def points(self) -> list[tuple[int, str]]:
        return list(self.index)


def steer_delta(
    stream: torch.Tensor, table: torch.Tensor, index: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """``[n, hidden]`` float32: what one point adds to each of the ``n`` tokens."""
    n = stream.shape[0]
    idx, c = index[:n], coef[:n]
    norm = torch.linalg.vector_norm(stream.float(), dim=-1, keepdim=True)  # [n, 1]
    w = c[:, :, 0] + c[:, :, 1] * norm  # [n, K]
    delta = w[:, 0:1] * table.index_select(0, idx[:, 0]).float()
    for k in range(1, idx.shape[1]):  # one [n, hidden] at a time, never [n, K, hidden]
        delta = delta + w[:, k : k + 1] * table.index_select(0, idx[:, k]).float()
    return delta


def steer_point(layer: nn.Module, hook: str, stream: torch.Tensor, target: torch.Tensor):
    """``target + delta``, with delta computed from ``stream`` at ``(layer, hook)``."""
    delta = steer_delta(
        stream,
        layer._actbus_steer_table,
        getattr(layer, f"_actbus_steer_{hook}_index"),
        getattr(layer, f"_actbus_steer_{hook}_coef"),
    )
    return target + delta.to(target.dtype)


def install_steering(
    decoder: nn.ModuleList,
    *,
    architecture: str,
    layers: tuple[int, ...],
    hooks: tuple[str, ...],
    hidden_size: int,
    max_rows: int,
    per_token: int,
    max_vectors: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SteerTables:
    """Register the tables on ``layers`` of ``decoder`` and wrap their post-attention
    norms; the layer's own forward is wrapped by ``actbus.capture.taps.wrap_layer``,
    which reads ``_actbus_steer_hooks``."""
    table = torch.zeros(max_vectors, hidden_size, dtype=dtype, device=device)
    tables = SteerTables(table, {}, {}, per_token, max_rows)
    for layer_idx in layers:
        layer = decoder[layer_idx]
        layer.register_buffer("_actbus_steer_table", table, persistent=False)
        for hook in hooks:
            index = torch.zeros(max_rows, per_token, dtype=torch.int64, device=device)
            coef = torch.zeros(max_rows, per_token, 2, dtype=torch.float32, device=device)
            layer.register_buffer(f"_actbus_steer_{hook}_index", index, persistent=False)
            layer.register_buffer(f"_actbus_steer_{hook}_coef", coef, persistent=False)
            tables.index[(layer_idx, hook)] = index
            tables.coef[(layer_idx, hook)] = coef
        layer._actbus_steer_hooks = tuple(hooks)
        if "post_attn" in hooks:
            _wrap_post_attn_norm(layer, POST_ATTN_NORM.get(architecture, DEFAULT_POST_ATTN_NORM))
    return tables


def _wrap_post_attn_norm(layer: nn.Module, name: str) -> None:
    norm = getattr(layer, name, None)
    if norm is None:
        raise RuntimeError(f"actbus: {type(layer).__name__} has no {name} to steer post_attn at")
    inner = norm.forward

    def forward(x, residual=None, *args, **kwargs):
        if residual is None:
            raise RuntimeError(f"actbus: {name} was called without a residual; cannot steer it")
        # The norm adds x to residual: adding the vector to residual first steers the sum.
        residual = steer_point(layer, "post_attn", x + residual, residual)
        return inner(x, residual, *args, **kwargs)

    norm.forward = forward
