"""Lightning callbacks of the trainers: SAE and probe checkpoints (each module returns
its own from ``configure_callbacks``), data-path metrics, the duty-cycle cap and the
progress bar."""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar

from trainers.checkpoint import save_probe, save_sae
from trainers.data import bus_drops


class DutyCycle(pl.Callback):
    """Keep training steps to at most ``share`` of wall time by resting after each one.

    A trainer on the engine's GPU takes GPU time from generation (on an H100, an SAE
    training on every token of an 8B model's layer took about 15%). With a lossy policy
    (``drop_oldest``, ``sample``), capping the trainer's share caps what it costs the
    engine; what it cannot take in that time is dropped at the publisher, counted. A
    step's time is measured to the end of its device work (the device is synchronized),
    so it includes any wait the engine's kernels caused: the cap errs on the engine's side.
    """

    MAX_REST_S = 5.0  # one slow step never stops the trainer reading for longer

    def __init__(self, share: float) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--max-duty: expected a share in (0, 1], got {share}")
        self.share = share
        self.busy_s = 0.0
        self.rest_s = 0.0
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync(pl_module)
        busy = time.perf_counter() - self._t0
        self.busy_s += busy
        if self.share < 1.0:
            rest = min(busy * (1.0 / self.share - 1.0), self.MAX_REST_S)
            time.sleep(rest)
            self.rest_s += rest

    @property
    def duty(self) -> float:
        """The share of time spent in steps so far (steps over steps plus rests)."""
        total = self.busy_s + self.rest_s
        return self.busy_s / total if total else 0.0


def _sync(module: pl.LightningModule) -> None:
    import torch

    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)


class MetricsProgressBar(RichProgressBar):
    """Rich's bar, plus the module's ``pbar_metrics``: plain floats the module refreshes
    when it chooses, so showing them never waits for the device; and, on a live stream
    (``policy`` given), what the publisher dropped for this trainer so far under it."""

    def __init__(self, datamodule=None, policy: str | None = None) -> None:
        super().__init__()
        self.dm = datamodule
        self.policy = policy

    def get_metrics(self, trainer, pl_module) -> dict:
        out = {**super().get_metrics(trainer, pl_module), **getattr(pl_module, "pbar_metrics", {})}
        if self.dm is not None and self.policy is not None:
            dropped, routed = bus_drops(self.dm.stats())
            out["dropped"] = f"{dropped:,}/{routed:,} ({self.policy})"
        return out


def stream_info(trainer: pl.Trainer) -> dict:
    """What the data told of its source, for a checkpoint's ``source``: the model's
    name, width and dtype, the longest sequence, the publisher or stored run."""
    dm = getattr(trainer, "datamodule", None)
    return dm.stream_info() if hasattr(dm, "stream_info") else {}


class SaveSAEs(pl.Callback):
    """Every ``every_steps`` optimizer steps, and at the end: ``out/<name>/`` per SAE."""

    def __init__(self, out: str | Path, every_steps: int = 1000, model: str = "") -> None:
        self.out = Path(out)
        self.every = every_steps
        self.model = model
        self.saved: list[Path] = []

    def _save(self, trainer: pl.Trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        source = stream_info(trainer)
        for c in module.configs:
            sae = module.sae(c.name)
            if bool(sae.initialized):
                extra = {"step": trainer.global_step}
                path = self.out / c.name
                self.saved.append(save_sae(sae, path, model=self.model, source=source, extra=extra))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step and trainer.global_step % self.every == 0:
            self._save(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module)


class SaveProbes(pl.Callback):
    """When the fit ends: ``out/<name>/`` per probe, with its final metrics.

    ``on_fit_end``, not ``on_train_end``: Lightning runs the module's own
    ``on_train_end`` (where the last held-out metrics are computed) after callbacks'."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.saved: list[Path] = []

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        metrics = pl_module.fit_summary()["metrics"]
        source = stream_info(trainer)
        for c in pl_module.configs:
            m = {k: v for k, v in metrics.items() if k.startswith(f"{c.name}/")}
            self.saved.append(
                save_probe(pl_module.probe(c.name), self.out / c.name, metrics=m, source=source)
            )


class DataStats(pl.Callback):
    """Logs the data path's counters (bus drops, buffer fill, overflow) every few steps."""

    def __init__(self, datamodule, every_steps: int = 10) -> None:
        self.dm = datamodule
        self.every = max(1, every_steps)
        self.last: dict[str, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and hasattr(self.dm, "first_step"):
            self.dm.first_step()  # the warm-up is reported until now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx % self.every == 0:
            self._log(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._log(trainer)

    def _log(self, trainer) -> None:
        self.last = {f"data/{k}": float(v) for k, v in self.dm.stats().items()}
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(self.last, step=trainer.global_step)
