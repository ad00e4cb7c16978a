"""Sparse autoencoders as plain ``nn.Module``s: TopK (+AuxK), BatchTopK, ReLU+L1, JumpReLU.

No Lightning here: ``SAETrainer`` (``sae_module.py``) drives these, and the
benchmark can call ``training_loss`` directly where Lightning is not installed.

Conventions (shared with SAELens' layout): ``W_enc [d_in, d_sae]``, ``b_enc``,
``W_dec [d_sae, d_in]`` with unit-norm rows, ``b_dec [d_in]`` subtracted from the
input before encoding. Inputs are multiplied by ``norm_scale`` (one scalar, set from
the first batch so the mean squared norm is ``d_in``) and outputs divided by it, so
the model works in the stream's own units while training sees unit-scale data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainers.config import SAEConfig

# Steps between checks, on an accelerator, for whether any latent is dead (AuxK).
DEAD_CHECK_EVERY = 16


def geometric_median(x: torch.Tensor, iters: int = 30, eps: float = 1e-6) -> torch.Tensor:
    """Weiszfeld's algorithm: the point minimising the sum of distances to the rows."""
    m = x.mean(0)
    for _ in range(iters):
        w = 1.0 / (x - m).norm(dim=1).clamp_min(eps)
        new = (w[:, None] * x).sum(0) / w.sum()
        if (new - m).norm() < eps * (1 + m.norm()):
            return new
        m = new
    return m


class _JumpReLU(torch.autograd.Function):
    """z = pre * (pre > theta); theta gets a straight-through (rectangle kernel) gradient."""

    @staticmethod
    def forward(ctx, pre, theta, bandwidth):
        ctx.save_for_backward(pre, theta)
        ctx.bandwidth = bandwidth
        return pre * (pre > theta)

    @staticmethod
    def backward(ctx, grad):
        pre, theta = ctx.saved_tensors
        bw = ctx.bandwidth
        near = ((pre - theta).abs() < bw / 2).to(grad.dtype)
        g_theta = (-(theta / bw) * near * grad).sum(0)
        return grad * (pre > theta), g_theta, None


class _Step(torch.autograd.Function):
    """H(pre - theta) (the L0 count); theta gets a straight-through gradient."""

    @staticmethod
    def forward(ctx, pre, theta, bandwidth):
        ctx.save_for_backward(pre, theta)
        ctx.bandwidth = bandwidth
        return (pre > theta).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, theta = ctx.saved_tensors
        bw = ctx.bandwidth
        near = ((pre - theta).abs() < bw / 2).to(grad.dtype)
        return None, (-(1.0 / bw) * near * grad).sum(0), None


class _CentredBias(torch.autograd.Function):
    """``b_enc`` in value; its backward also gives ``b_dec`` the gradient of centring.

    The encoder computes ``(x - b_dec) @ W_enc + b_enc``. Centring with a live
    ``b_dec`` makes autograd compute the gradient of every input row, a
    ``[rows, d_sae] x [d_sae, d_in]`` matmul as large as the encoder's, only to sum
    it; summed first, it is ``-W_enc @ grad(b_enc)``: one matrix-vector product, in
    the dtype the encoder ran in, and no forward work at all.
    """

    @staticmethod
    def forward(ctx, b_enc, b_dec, w_enc):
        ctx.save_for_backward(w_enc)
        ctx.b_dec_dtype = b_dec.dtype
        return b_enc.clone()

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad, -(w @ grad.to(w.dtype)).to(ctx.b_dec_dtype), None


class _DecoderGrad(torch.autograd.Function):
    """Zero in value; its backward gives W_dec the gradient of a sparse decode.

    That gradient is code^T @ d(out), the code being the ``[rows, d_sae]`` matrix of
    the active values: one dense matmul in the compute dtype (tensor cores), where
    embedding_bag's weight gradient sorts the indices and reduces segments in fp32.
    Measured on an H100 at d=4096, 16x, k=64, 4096 tokens: 2.6 ms against 6.6 ms.
    """

    @staticmethod
    def forward(ctx, w_dec, values, cols, offsets, rows, dtype):
        ctx.save_for_backward(values, cols, offsets)
        ctx.shape, ctx.dtype, ctx.w_dtype = (rows, w_dec.shape[0]), dtype, w_dec.dtype
        return w_dec.new_zeros(rows, w_dec.shape[1])

    @staticmethod
    def backward(ctx, grad):
        values, cols, offsets = ctx.saved_tensors
        # The bag (row) of every value, without a sync: searchsorted over bag starts.
        nnz = torch.arange(cols.numel(), device=cols.device)
        bag = torch.searchsorted(offsets, nnz, right=True) - 1
        code = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        code[bag, cols] = values.to(ctx.dtype)
        g_w = (code.t() @ grad.to(ctx.dtype)).to(ctx.w_dtype)
        return g_w, None, None, None, None, None


class SparseAutoencoder(nn.Module):
    """One SAE; ``training_loss`` is a full training step's forward, ``forward`` inference."""

    def __init__(self, cfg: SAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, n = cfg.d_in, int(cfg.d_sae)
        gen = torch.Generator().manual_seed(cfg.seed)
        w_dec = F.normalize(torch.randn(n, d, generator=gen), dim=1)
        self.W_dec = nn.Parameter(w_dec)
        self.W_enc = nn.Parameter(w_dec.t().clone().contiguous())
        self.b_enc = nn.Parameter(torch.zeros(n))
        self.b_dec = nn.Parameter(torch.zeros(d))
        if cfg.kind == "jumprelu":
            self.log_threshold = nn.Parameter(
                torch.full((n,), math.log(cfg.jumprelu_init_threshold))
            )
        self.register_buffer("norm_scale", torch.ones(()))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        # batchtopk at inference: a per-token threshold, the running minimum kept value.
        self.register_buffer("threshold", torch.full((), -1.0))
        self.register_buffer("since_fired", torch.zeros(n, dtype=torch.long))
        self._steps = 0
        self._dead_seen = False

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def initialize(self, x: torch.Tensor) -> None:
        """From the first batch (stream units): the input scale, then the decoder bias."""
        x = x.to(self.W_enc.dtype)
        if self.cfg.normalize:
            ms = x.pow(2).sum(-1).mean()
            self.norm_scale.fill_(math.sqrt(self.cfg.d_in / max(float(ms), 1e-12)))
        xn = x * self.norm_scale
        if self.cfg.b_dec_init == "geometric_median":
            self.b_dec.copy_(geometric_median(xn[:4096]))
        elif self.cfg.b_dec_init == "mean":
            self.b_dec.copy_(xn.mean(0))
        self.initialized.fill_(True)

    # ------------------------------------------------------------------- pieces
    def pre_acts(self, xn: torch.Tensor) -> torch.Tensor:
        w, b_enc, b_dec = self.W_enc, self.b_enc, self.b_dec.detach()
        dev = xn.device.type
        if torch.is_autocast_enabled(dev):
            # Under autocast the whole pre-activation is in the compute dtype, bias
            # included: it is the step's largest tensor ([rows, d_sae]), and top-k,
            # ReLU and their backwards all read it. An fp32 bias would promote it.
            dtype = torch.get_autocast_dtype(dev)
            w, b_dec = w.to(dtype), b_dec.to(dtype)
        if torch.is_grad_enabled() and self.b_dec.requires_grad:
            b_enc = _CentredBias.apply(b_enc, self.b_dec, w.detach())
        return (xn.to(w.dtype) - b_dec) @ w + b_enc.to(w.dtype)

    def _decode_bags(
        self, values: torch.Tensor, cols: torch.Tensor, offsets: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """sum_j values_j * W_dec[cols_j] per bag: a gather, not a [rows, d_sae] matmul."""
        if self.cfg.decoder == "dense":
            z = torch.zeros(rows, int(self.cfg.d_sae), dtype=values.dtype, device=values.device)
            bag = torch.repeat_interleave(
                torch.arange(rows, device=cols.device),
                torch.diff(offsets, append=offsets.new_tensor([cols.numel()])),
            )
            z = z.index_put((bag, cols), values)
            return z @ self.W_dec
        w = self.W_dec
        # A gather, memory-bound: kept in the weights' dtype whatever autocast would pick
        # (CUDA has no bf16 kernel for the gradient of per_sample_weights either).
        # W_dec enters detached: embedding_bag's own weight gradient (a sort and a
        # segment reduction in fp32) is replaced by _DecoderGrad's matmul.
        with torch.autocast(device_type=values.device.type, enabled=False):
            out = F.embedding_bag(
                cols, w.detach(), offsets, mode="sum", per_sample_weights=values.to(w.dtype)
            )
        if torch.is_grad_enabled() and w.requires_grad:
            dev = values.device.type
            dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w.dtype
            out = out + _DecoderGrad.apply(w, values.detach(), cols, offsets, rows, dtype)
        return out

    def _sparse_code(
        self, pre: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, latent indices, bag offsets) of the active latents, bags = tokens."""
        rows, k = pre.shape[0], self.cfg.k
        if self.cfg.kind == "topk":
            v, i = F.relu(pre).topk(k, dim=-1, sorted=False)
            offsets = torch.arange(rows, device=pre.device) * k
            return v.reshape(-1), i.reshape(-1), offsets
        # batchtopk: the k * rows largest over the whole batch (training), or a threshold.
        if training or float(self.threshold) < 0:
            flat = F.relu(pre).reshape(-1)
            v, i = flat.topk(min(k * rows, flat.numel()), sorted=False)
            keep = v > 0
            v, i = v[keep], i[keep]
            if training and v.numel():
                lo = v.detach().min()
                with torch.no_grad():
                    t = self.threshold
                    t.copy_(lo if float(t) < 0 else 0.99 * t + 0.01 * lo)
        else:
            mask = pre > self.threshold
            i = mask.reshape(-1).nonzero().squeeze(1)
            v = pre.reshape(-1)[i]
        i, order = i.sort()
        v = v[order]
        row = torch.div(i, pre.shape[1], rounding_mode="floor")
        counts = torch.bincount(row, minlength=rows)
        offsets = torch.cumsum(counts, 0) - counts
        return v, i - row * pre.shape[1], offsets

    def _dense_code(self, pre: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "relu":
            return F.relu(pre)
        theta = self.log_threshold.exp()
        return _JumpReLU.apply(pre, theta, self.cfg.jumprelu_bandwidth)

    # ----------------------------------------------------------------- training
    def training_loss(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss and metrics of one batch of stream-unit rows ``x [rows, d_in]``."""
        cfg = self.cfg
        xn = x.to(self.W_enc.dtype) * self.norm_scale
        rows = xn.shape[0]
        pre = self.pre_acts(xn)
        if cfg.kind in ("topk", "batchtopk"):
            values, cols, offsets = self._sparse_code(pre, training=True)
            x_hat = self._decode_bags(values, cols, offsets, rows) + self.b_dec
            # index_fill_, not fired[cols] = True: that copies the True from the host (a sync).
            fired = torch.zeros(int(cfg.d_sae), dtype=torch.bool, device=pre.device)
            fired.index_fill_(0, cols, True)
            l0 = pre.new_full((), cols.numel() / max(rows, 1))  # a fill: no host copy
        else:
            z = self._dense_code(pre)
            x_hat = z @ self.W_dec + self.b_dec
            fired = (z > 0).any(0)
            l0 = (z > 0).sum(-1).float().mean()
        err = x_hat - xn
        total_var = (xn - xn.mean(0)).pow(2).sum().clamp_min(1e-12).detach()
        fvu = err.pow(2).sum() / total_var
        out = {"fvu": fvu, "mse": err.pow(2).mean(), "l0": l0}
        with torch.no_grad():  # masked_fill_, not boolean indexing: no device sync
            self.since_fired.add_(rows).masked_fill_(fired, 0)
        dead = self.since_fired >= cfg.dead_tokens
        out["dead_frac"] = dead.float().mean()
        # Trained on the squared error per token (summed over dimensions), not on the
        # FVU: the same minimum, but gradients large enough that Adam's eps stays negligible.
        per_token = total_var / max(rows, 1)
        loss = fvu * per_token
        if cfg.kind in ("topk", "batchtopk") and cfg.aux_k:
            aux = torch.zeros((), device=pre.device)
            if self._any_dead(dead):
                # Non-dead latents are masked to -inf: past the dead ones, topk picks
                # zeros, so a fixed k needs no count of the dead (a device sync).
                ka = min(int(cfg.aux_k), int(cfg.d_sae))
                v, i = pre.masked_fill(~dead, -torch.inf).topk(ka, dim=-1, sorted=False)
                offs = torch.arange(rows, device=pre.device) * ka
                e_hat = self._decode_bags(F.relu(v).reshape(-1), i.reshape(-1), offs, rows)
                aux = (e_hat + err.detach()).pow(2).sum() / total_var
            out["auxk"] = aux
            loss = loss + cfg.aux_coeff * aux * per_token
        elif cfg.kind == "relu":
            l1 = (z * self.W_dec.norm(dim=1)).sum(-1).mean() / math.sqrt(cfg.d_in)
            out["l1"] = l1
            loss = loss + cfg.l1_coeff * l1 * per_token
        elif cfg.kind == "jumprelu":
            theta = self.log_threshold.exp()
            l0_ste = _Step.apply(pre, theta, cfg.jumprelu_bandwidth).sum(-1).mean()
            loss = loss + cfg.l0_coeff * l0_ste * per_token
        out["loss"] = loss
        return out

    def _any_dead(self, dead: torch.Tensor) -> bool:
        """Whether AuxK has dead latents to work on. Asking costs a device sync, so
        on an accelerator the answer is refreshed every ``DEAD_CHECK_EVERY`` steps
        (latents die over millions of tokens; a few steps late changes nothing)."""
        self._steps += 1
        if dead.device.type == "cpu" or self._steps % DEAD_CHECK_EVERY == 1:
            self._dead_seen = bool(dead.any())
        return self._dead_seen

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Keep only the part of the decoder's gradient that does not change row norms."""
        g, w = self.W_dec.grad, self.W_dec
        if g is not None:
            # Row-wise dot products by a batched matmul and the update in one fused
            # pass: no [d_sae, d_in] temporaries (half the time of the plain form on GPU).
            dots = torch.bmm(g.unsqueeze(1), w.unsqueeze(2)).view(-1, 1)
            g.addcmul_(dots, w, value=-1.0)

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec.div_(torch.linalg.vector_norm(self.W_dec, dim=1, keepdim=True).clamp_min(1e-12))

    # ---------------------------------------------------------------- inference
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Dense latents ``[rows, d_sae]`` of stream-unit rows (batchtopk: by threshold)."""
        pre = self.pre_acts(x.to(self.W_enc.dtype) * self.norm_scale)
        if self.cfg.kind in ("topk", "batchtopk"):
            v, cols, offsets = self._sparse_code(pre, training=False)
            z = torch.zeros_like(pre)
            counts = torch.diff(offsets, append=offsets.new_tensor([cols.numel()]))
            bag = torch.repeat_interleave(torch.arange(pre.shape[0], device=pre.device), counts)
            return z.index_put((bag, cols), v)
        return self._dense_code(pre)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return (z @ self.W_dec + self.b_dec) / self.norm_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction of ``x`` in the stream's units."""
        return self.decode(self.encode(x))
