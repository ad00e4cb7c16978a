"""SAEs as one LightningModule: any number of them, each on its own stream.

Several SAEs (different layers, sizes or k) share one DataModule, so one
subscription feeds them all. Their parameters are disjoint, so one Adam over all
of them (a parameter group each, with its own learning rate) updates each exactly
as its own optimizer would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from trainers.callbacks import SaveSAEs
from trainers.config import SAEConfig
from trainers.optim import adam
from trainers.sae import SparseAutoencoder

PBAR_EVERY = 25
"""Steps between two reads of the progress bar's FVU on an accelerator (each a sync)."""


def module_key(name: str) -> str:
    """``nn.ModuleDict`` keys may not contain dots."""
    return name.replace(".", "_")


class SAETrainer(pl.LightningModule):
    """Trains ``SparseAutoencoder``s on batches from ``ActivationDataModule``."""

    def __init__(
        self,
        configs: list[SAEConfig],
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 1000,
    ) -> None:
        """``checkpoint_dir``: each SAE is saved to ``<dir>/<name>/`` every
        ``checkpoint_every`` optimizer steps and at the end (None: not saved)."""
        super().__init__()
        if not configs:
            raise ValueError("configs: give at least one SAEConfig")
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"SAE names must be unique, got {names}")
        self.configs = list(configs)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.saes = nn.ModuleDict({module_key(c.name): SparseAutoencoder(c) for c in configs})
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.fvu_history: dict[str, list[float]] = {c.name: [] for c in configs}
        self.pbar_metrics: dict[str, float] = {}
        """What the progress bar shows beside Lightning's own (``MetricsProgressBar``)."""

    def _items(self):
        for c in self.configs:
            yield c, self.saes[module_key(c.name)]

    def configure_callbacks(self) -> list[pl.Callback]:
        """The SAEs' own checkpoints (Lightning adds these to the trainer's callbacks)."""
        if self.checkpoint_dir is None:
            return []
        return [SaveSAEs(self.checkpoint_dir, self.checkpoint_every)]

    def fit_summary(self) -> dict[str, Any]:
        """What a finished fit reports: the last metrics and each SAE's FVU history."""
        return {
            "metrics": {k: float(v) for k, v in self.last_metrics.items()},
            "fvu_history": self.fvu_history,
        }

    def configure_optimizers(self):
        groups = [{"params": list(sae.parameters()), "lr": c.lr} for c, sae in self._items()]
        return adam(groups, betas=(0.9, 0.999))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        exhausted = bool(batch.get("_exhausted", False))
        loss = torch.zeros((), device=self.device)
        logs: dict[str, float] = {}
        for c, sae in self._items():
            x = batch[c.stream]["activation"]
            if batch_idx == 0 and not bool(sae.initialized) and x.shape[0]:
                sae.initialize(x)
            if batch_idx == 0:  # every rank takes part, whatever its first batch held
                self._broadcast_init(sae)
            if x.shape[0] == 0:  # this rank's stream ended: join the collectives, learn nothing
                loss = loss + 0.0 * sum(p.sum() for p in sae.parameters())
                continue
            out = sae.training_loss(x)
            loss = loss + out["loss"]
            for k, v in out.items():
                logs[f"{c.name}/{k}"] = v.detach()  # tensors: no device sync per step
            if self.device.type == "cpu" or batch_idx % 100 == 0:
                self.fvu_history[c.name].append(float(out["fvu"].detach()))
        self._sync_stop(exhausted)
        if logs:
            self.last_metrics = logs  # type: ignore[assignment]
            self.log_dict(logs, on_step=True, prog_bar=False, batch_size=1, rank_zero_only=True)
            # Not self.log(..., prog_bar=True): Lightning turns progress-bar values into
            # Python numbers every step, a device sync that left an H100 idle for a
            # fifth of each step. The bar shows this float, read every PBAR_EVERY steps.
            fvu = logs.get(f"{self.configs[0].name}/fvu")
            if fvu is not None and (self.device.type == "cpu" or batch_idx % PBAR_EVERY == 0):
                self.pbar_metrics["fvu"] = float(fvu)
        return loss

    def _broadcast_init(self, sae: SparseAutoencoder) -> None:
        """Ranks initialise from different first batches: rank 0's values win."""
        if dist.is_available() and dist.is_initialized():
            for t in (sae.norm_scale, sae.b_dec.data):
                dist.broadcast(t, src=0)
            sae.initialized.fill_(True)

    def _sync_stop(self, exhausted: bool) -> None:
        """Stop every rank once all of them ran out of data (single process: never needed)."""
        if self.trainer.world_size > 1:
            flag = torch.tensor([0.0 if exhausted else 1.0], device=self.device)
            flag = self.trainer.strategy.reduce(flag, reduce_op="sum")
            if float(flag) == 0:
                self.trainer.should_stop = True

    def on_before_optimizer_step(self, optimizer) -> None:
        for _, sae in self._items():
            sae.remove_parallel_grad()

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        for _, sae in self._items():
            sae.normalize_decoder()

    def sae(self, name: str) -> SparseAutoencoder:
        return self.saes[module_key(name)]
