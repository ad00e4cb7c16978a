"""Ground truth through the real bus: a publisher process of synthetic activations with a
planted dictionary -> ipc socket -> the trainers' bus DataModule -> Lightning.

TopK and BatchTopK SAEs must recover the planted atoms (mean over atoms of the best
cosine with a decoder row >= 0.95); a logistic probe must recover a planted linear
label from request tags (held-out accuracy >= 0.95), and its W&B run (offline) must
hold the metrics, read back from the run's own file.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.support.trainer_synth import SynthPublisher, planted
from trainers.config import DataConfig, ProbeConfig, SAEConfig
from trainers.data import ActivationDataModule
from trainers.probe import ProbeTrainer
from trainers.sae_module import SAETrainer
from trainers.wandb_log import make_logger, read_history, run_files

ROOT = Path(__file__).resolve().parents[2]


def _trainer(**kw) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def best_cos(w_dec: torch.Tensor, atoms: torch.Tensor) -> float:
    w = torch.nn.functional.normalize(w_dec.detach(), dim=1)
    return float((atoms @ w.t()).max(1).values.mean())


def _recover(tmp_path, cfg: SAEConfig, messages: int) -> float:
    torch.set_num_threads(1)
    address = f"ipc://{tmp_path}/synth.sock"
    pub = SynthPublisher(address, messages)
    data = DataConfig(
        streams=((0, "post_block"),),
        address=address,
        policy="block",
        batch_tokens=512,
        buffer_tokens=8192,
        warmup_tokens=4096,
        idle_s=20,
    )
    module = SAETrainer([cfg])
    t0 = time.monotonic()
    try:
        _trainer(logger=False).fit(module, datamodule=ActivationDataModule(data))
    finally:
        pub.stop()
    atoms, _ = planted()
    cos = best_cos(module.sae(cfg.name).W_dec, atoms)
    stats = module.trainer.datamodule.stats()
    print(f"\n{cfg.kind}: best-cosine {cos:.4f} in {time.monotonic() - t0:.1f}s; data {stats}")
    # Every published token reached the trainer (block policy): nothing lost on the way.
    assert stats["tokens/L0.post_block"] == messages * 512
    assert stats["bus/missed"] == 0
    # A fresh SAE is nowhere near: the bar means something.
    assert best_cos(SAETrainer([cfg]).sae(cfg.name).W_dec, atoms) < 0.6
    return cos


COMMON = dict(d_in=64, d_sae=1024, k=4, lr=3e-3, layer=0)


def test_topk_recovers_planted_atoms_through_the_bus(tmp_path):
    cfg = SAEConfig(kind="topk", aux_k=0, **COMMON)
    assert _recover(tmp_path, cfg, messages=600) >= 0.95


def test_batchtopk_recovers_planted_atoms_through_the_bus(tmp_path):
    """BatchTopK leaves more latents dead early on: AuxK over a short window revives them."""
    cfg = SAEConfig(
        kind="batchtopk",
        aux_k=256,
        aux_coeff=1.0,
        dead_tokens=1536,
        normalize=False,
        b_dec_init="zeros",
        **{**COMMON, "lr": 6e-3},
    )
    assert _recover(tmp_path, cfg, messages=900) >= 0.95


def test_probe_recovers_planted_label_from_request_tags(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.set_num_threads(1)
    address = f"ipc://{tmp_path}/synth.sock"
    pub = SynthPublisher(address, 150, "--label-shift", "1.0", "--requests", "16")
    probe = ProbeConfig(d_in=64, labels=("label",), heldout=0.25, lr=1e-2)
    data = DataConfig(
        streams=((0, "post_block"),),
        address=address,
        policy="block",
        batch_tokens=512,
        buffer_tokens=8192,
        warmup_tokens=2048,
        idle_s=20,
        label_tags=("label",),
        labelled_only=True,
    )
    module = ProbeTrainer([probe], ("label",))
    logger = make_logger("actbus-test", "probe", tmp_path / "wb", {"probe": probe.to_dict()})
    try:
        _trainer(logger=logger, log_every_n_steps=5).fit(
            module, datamodule=ActivationDataModule(data)
        )
        logger.experiment.finish()
    finally:
        pub.stop()
    acc = module.last_metrics[f"{probe.name}/label/heldout_accuracy"]
    auroc = module.last_metrics[f"{probe.name}/label/heldout_auroc"]
    print(f"\nheld-out accuracy {acc:.4f} auroc {auroc:.4f} over {module.heldout_rows} rows")
    assert module.heldout_rows > 1000
    assert acc >= 0.95 and auroc >= 0.95
    # The weights point along the planted direction (not some spurious feature).
    _, direction = planted()
    w = module.probe(probe.name).linear.weight[0] * module.probe(probe.name).inv_std
    # (not exactly it: logistic regression weights are the noise-whitened direction)
    assert float(torch.nn.functional.cosine_similarity(w.detach(), direction, dim=0)) > 0.8
    # The offline W&B run holds the held-out metric and the training loss.
    files = run_files(tmp_path / "wb")
    assert len(files) == 1, files
    rows = read_history(files[0])
    keys = set().union(*rows)
    assert f"{probe.name}/label/heldout_accuracy" in keys, sorted(keys)
    assert f"{probe.name}/loss" in keys
    logged = [
        r[f"{probe.name}/label/heldout_accuracy"]
        for r in rows
        if f"{probe.name}/label/heldout_accuracy" in r
    ]
    assert logged[-1] == pytest.approx(acc)
