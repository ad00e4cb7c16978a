"""A linear probe as a plain ``nn.Module``: the math alone, for training
(``probe.ProbeTrainer``) and for loading a saved probe (``checkpoint.load_probe``)
without Lightning's training loop."""

from __future__ import annotations

import torch
from torch import nn

from trainers.config import ProbeConfig


class LinearProbe(nn.Module):
    """Standardise (per-feature mean/std from the first batch), then one linear layer."""

    def __init__(self, cfg: ProbeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.linear = nn.Linear(cfg.d_in, len(cfg.labels))
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.register_buffer("mean", torch.zeros(cfg.d_in))
        self.register_buffer("inv_std", torch.ones(cfg.d_in))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def initialize(self, x: torch.Tensor) -> None:
        if self.cfg.normalize:
            x = x.float()
            self.mean.copy_(x.mean(0))
            self.inv_std.copy_(1.0 / x.std(0).clamp_min(1e-6) if len(x) > 1 else self.inv_std)
        self.initialized.fill_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (logistic) or predictions (linear), ``[rows, heads]``."""
        return self.linear((x.float() - self.mean) * self.inv_std)
