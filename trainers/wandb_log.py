"""W&B for the trainers: the logger they use, and reading an offline run back.

Runs log through Lightning's ``WandbLogger``; without W&B credentials (or with
``WANDB_MODE=offline``) the run is written under ``save_dir/wandb/offline-run-*``
and can be uploaded later with ``wandb sync``. Reading a run's ``.wandb`` file back
(tests, scripts) uses ``consumers.wandb_offline``, shared with the W&B dashboard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consumers.wandb_offline import history as read_history
from consumers.wandb_offline import offline_mode

__all__ = ["make_logger", "read_history", "run_files"]


def make_logger(project: str, name: str, save_dir: str | Path, config: dict[str, Any]):
    """A ``WandbLogger``: online where the user has W&B set up, offline otherwise."""
    from lightning.pytorch.loggers import WandbLogger

    offline = offline_mode()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    # The group comes from WANDB_RUN_GROUP (wandb reads it), shared with `actbus run wandb`.
    return WandbLogger(
        project=project,
        name=name,
        save_dir=str(save_dir),
        offline=offline,
        config=config,
        job_type="train",
        # Lightning asks for offline through WANDB_MODE, which wandb reads once per
        # process: after an earlier wandb.init here it would try to log in. Say it to
        # wandb.init itself.
        **({"mode": "offline"} if offline else {}),
    )


def run_files(save_dir: str | Path) -> list[Path]:
    """The ``.wandb`` files of the runs under ``save_dir`` (offline or synced)."""
    return sorted(Path(save_dir).glob("wandb/*run-*/run-*.wandb"))
