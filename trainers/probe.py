"""Linear probes as a LightningModule: logistic or linear heads on one or more streams.

Labels are request tags carried on the bus (``extra_args["actbus"]["tags"]``),
one head per tag. The held-out split is by request (a hash of the request id), so
no request's tokens are in both: each batch's held-out rows only update the
metrics (accuracy and AUROC, or R²), the others train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn

from trainers.callbacks import SaveProbes
from trainers.config import ProbeConfig
from trainers.linear_probe import LinearProbe
from trainers.sae_module import module_key


class ProbeTrainer(pl.LightningModule):
    """Probes on streams of ``ActivationDataModule`` batches (with ``label_tags``)."""

    def __init__(
        self,
        configs: list[ProbeConfig],
        label_tags: tuple[str, ...],
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        """``checkpoint_dir``: each probe is saved to ``<dir>/<name>/`` with its final
        metrics when the fit ends (None: not saved)."""
        super().__init__()
        self.configs = list(configs)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.label_tags = tuple(label_tags)
        for c in configs:
            missing = [t for t in c.labels if t not in self.label_tags]
            if missing:
                raise ValueError(f"probe {c.name}: labels {missing} are not read from the stream")
        self.probes = nn.ModuleDict({module_key(c.name): LinearProbe(c) for c in configs})
        self.metrics = nn.ModuleDict()
        self._metric_names: dict[str, str] = {}  # module key -> NAME/TAG, as logged
        for c in configs:
            for t in c.labels:
                key = module_key(f"{c.name}/{t}")
                self._metric_names[key] = f"{c.name}/{t}"
                if c.kind == "logistic":
                    self.metrics[key] = torchmetrics.MetricCollection(
                        {
                            "accuracy": torchmetrics.classification.BinaryAccuracy(),
                            "auroc": torchmetrics.classification.BinaryAUROC(),
                        }
                    )
                else:
                    self.metrics[key] = torchmetrics.MetricCollection(
                        {"r2": torchmetrics.R2Score()}
                    )
        self.last_metrics: dict[str, float] = {}
        self.heldout_rows = 0
        self._updated: set[str] = set()
        self._classes: dict[str, set[int]] = {}  # per window: AUROC needs both classes

    def configure_callbacks(self) -> list[pl.Callback]:
        """The probes' own checkpoints (Lightning adds these to the trainer's callbacks)."""
        return [] if self.checkpoint_dir is None else [SaveProbes(self.checkpoint_dir)]

    def fit_summary(self) -> dict[str, Any]:
        """What a finished fit reports: the last metrics (held-out ones included)."""
        return {"metrics": {k: float(v) for k, v in self.last_metrics.items()}}

    def probe(self, name: str) -> LinearProbe:
        return self.probes[module_key(name)]

    def configure_optimizers(self):
        groups = [
            {
                "params": list(self.probes[module_key(c.name)].parameters()),
                "lr": c.lr,
                "weight_decay": c.weight_decay,
            }
            for c in self.configs
        ]
        return torch.optim.AdamW(groups)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        exhausted = bool(batch.get("_exhausted", False))
        loss = torch.zeros((), device=self.device)
        logs: dict[str, float] = {}
        for c in self.configs:
            probe = self.probes[module_key(c.name)]
            b = batch[c.stream]
            x = b["activation"]
            if not bool(probe.initialized) and x.shape[0]:
                probe.initialize(x)
            if batch_idx == 0 and dist.is_available() and dist.is_initialized():
                for t in (probe.mean, probe.inv_std):  # rank 0's wins
                    dist.broadcast(t, src=0)
                probe.initialized.fill_(True)
            if x.shape[0] == 0:
                loss = loss + 0.0 * sum(p.sum() for p in probe.parameters())
                continue
            cols = [self.label_tags.index(t) for t in c.labels]
            y = b["label"][:, cols].to(self.device)
            held = (b["split"] < c.heldout).to(self.device)
            out = probe(x)
            known = ~torch.isnan(y)
            train = known & ~held[:, None]
            yz = torch.nan_to_num(y)
            if c.kind == "logistic":
                per = F.binary_cross_entropy_with_logits(out, yz, reduction="none")
            else:
                per = (out - yz).pow(2)
            n_train = train.sum()
            head_loss = (per * train).sum() / n_train.clamp_min(1)
            loss = loss + head_loss
            logs[f"{c.name}/loss"] = float(head_loss.detach())
            with torch.no_grad():
                for j, t in enumerate(c.labels):
                    m = known[:, j] & held
                    if m.any():
                        pred = out[m, j]
                        target = yz[m, j]
                        if c.kind == "logistic":
                            self.metrics[module_key(f"{c.name}/{t}")].update(
                                torch.sigmoid(pred), target.long()
                            )
                        else:
                            self.metrics[module_key(f"{c.name}/{t}")].update(pred, target)
                        self.heldout_rows += int(m.sum())
                        key = module_key(f"{c.name}/{t}")
                        self._updated.add(key)
                        seen = self._classes.setdefault(key, set())
                        if c.kind == "logistic" and len(seen) < 2:
                            seen.update(target.long().unique().tolist())
        self._sync_stop(exhausted)
        if logs:
            self.log_dict(logs, on_step=True, batch_size=1, rank_zero_only=True)
        if batch_idx % 10 == 9:
            self._log_heldout()
        return loss

    def _sync_stop(self, exhausted: bool) -> None:
        if self.trainer.world_size > 1:
            flag = torch.tensor([0.0 if exhausted else 1.0], device=self.device)
            if float(self.trainer.strategy.reduce(flag, reduce_op="sum")) == 0:
                self.trainer.should_stop = True

    def _log_heldout(self, final: bool = False) -> None:
        """Held-out metrics over the window since the last call, then a fresh window."""
        out: dict[str, float] = {}
        for key, coll in self.metrics.items():
            if key not in self._updated:
                continue
            try:
                vals = coll.compute()
            except (ValueError, RuntimeError):  # e.g. one class only so far
                continue
            for name, v in vals.items():
                if name == "auroc" and len(self._classes.get(key, ())) < 2:
                    continue  # undefined with one class in the window (torchmetrics says 0)
                if torch.isfinite(v):
                    out[f"{self._metric_names[key]}/heldout_{name}"] = float(v)
            coll.reset()
        self._updated.clear()
        self._classes.clear()
        if not out:
            return
        self.last_metrics.update(out)
        if final:  # Lightning allows self.log only inside steps
            if self.logger is not None and self.trainer.is_global_zero:
                self.logger.log_metrics(out, step=self.global_step)
        else:
            self.log_dict(out, on_step=True, batch_size=1, rank_zero_only=True)

    def on_train_end(self) -> None:
        self._log_heldout(final=True)
