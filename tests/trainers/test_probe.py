"""Probes: their checkpoints reload to the same predictions with their label mapping, and
a request whose label is not a number (tags come from HTTP clients) is counted and
skipped, live and from a stored run, instead of ending the probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch

from actbus.bus import Publisher
from actbus.wire import Header, RowIndex
from consumers.fs.sink import FsSink  # noqa: F401  (the sink that writes --from runs)
from tests.support.procs import start_sink, stop, wait_for
from trainers.checkpoint import load_probe, save_probe
from trainers.config import DataConfig, ProbeConfig
from trainers.data import ActivationDataModule
from trainers.probe import ProbeTrainer
from trainers.sae_module import module_key

ROOT = Path(__file__).resolve().parents[2]
D, REQS, PER = 64, 8, 32
BAD = "<img src=x onerror=alert(1)>"


def _direction() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)


def _rows(g: torch.Generator, labels: torch.Tensor) -> torch.Tensor:
    """Rows whose label is linear in them: noise plus +-1 along one direction."""
    x = torch.randn(len(labels) * PER, D, generator=g) * 0.3
    return x + (2 * labels.float() - 1).repeat_interleave(PER)[:, None] * _direction()


def _publish(pub: Publisher, steps: int, bad_step: int | None = None) -> None:
    """``steps`` messages of 8 labelled requests; at ``bad_step`` one request's label is
    an HTML string, as an HTTP client could send."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        labels = torch.randint(0, 2, (REQS,), generator=g)
        tags: list[dict] = [{"label": int(v)} for v in labels]
        if step == bad_step:
            tags[3] = {"label": BAD}
        ri = RowIndex(
            [f"q{step}-{i}" for i in range(REQS)],
            np.arange(REQS + 1, dtype=np.int64) * PER,
            np.tile(np.arange(PER), REQS),
            np.zeros(REQS * PER, dtype=np.int64),
            tags=tags,
        )
        x = _rows(g, labels)
        pub.publish(Header(step, 0, "post_block", "float32", tuple(x.shape), "synth", ri), x)


def _run(kind: str, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "actbus.cli", "run", kind, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _accuracy(probe) -> float:
    g = torch.Generator().manual_seed(99)
    labels = torch.randint(0, 2, (64,), generator=g)
    with torch.no_grad():
        pred = probe(_rows(g, labels))[:, 0] > 0
    return float((pred == labels.repeat_interleave(PER).bool()).float().mean())


def test_probe_checkpoint_reloads_to_the_same_predictions(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "synth", "hidden_size": D}, heartbeat_s=0.2)
    data = DataConfig(
        streams=((0, "post_block"),),
        address=address,
        policy="block",
        batch_tokens=256,
        buffer_tokens=2048,
        warmup_tokens=512,
        label_tags=("label",),
        labelled_only=True,
        name="probe",
    )
    cfg = ProbeConfig(d_in=D, labels=("label",), heldout=0.25, lr=0.05)
    module = ProbeTrainer([cfg], ("label",))
    dm = ActivationDataModule(data)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        feed = threading.Thread(
            target=lambda: (
                wait_for(lambda: pub.stats()["subscribers"], 30, "the probe to subscribe"),
                _publish(pub, 40),
                pub.close(timeout=30),
            )
        )
        feed.start()
        with warnings.catch_warnings():
            # Warnings of actbus's own code fail the test (Lightning's own are its own).
            warnings.filterwarnings("error", module="trainers")
            trainer.fit(module, datamodule=dm)
        feed.join(timeout=60)
    finally:
        pub.close(timeout=1)
    probe = module.probes[module_key(cfg.name)].eval()
    assert _accuracy(probe) > 0.95

    path = save_probe(probe, tmp_path / "probe", metrics=dict(module.last_metrics))
    meta = json.loads((path / "probe.json").read_text())
    assert meta["heads"] == {"label": 0}
    assert meta["hook_name"] == "blocks.0.hook_resid_post"
    assert "logit" in meta["output"]
    loaded = load_probe(path)
    assert loaded is not probe and loaded.cfg.labels == ("label",)
    x = _rows(torch.Generator().manual_seed(5), torch.tensor([0, 1, 1, 0]))
    with torch.no_grad():
        assert torch.equal(loaded(x), probe(x))


def test_a_label_that_is_not_a_number_is_counted_and_skipped(tmp_path):
    """Live (--connect) and stored (--from): the probe trains on every other request,
    saves, and reports the 32 rows of the one bad request as data/bad_label_rows."""
    address = f"ipc://{tmp_path}/bus.sock"
    run_dir = tmp_path / "run"
    pub = Publisher(address, info={"model": "synth", "hidden_size": D}, heartbeat_s=0.2)
    sink = start_sink(address, run_dir, "--exit-on-end")
    common = ["--layer", "0", "--d-in", str(D), "--batch-tokens", "256", "--buffer-tokens", "2048"]
    common += ["--warmup-tokens", "512", "--no-progress", "--label", "label", "--lr", "0.05"]
    probe = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "run", "probe", "--connect", address, *common,
         "--policy", "block", "--out", str(tmp_path / "live"),
         "--summary", str(tmp_path / "live.json")],
        cwd=ROOT,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: len(pub.stats()["subscribers"]) >= 2, 60, "the sink and the probe")
        _publish(pub, 40, bad_step=5)
        pub.close(timeout=30)
        out, _ = probe.communicate(timeout=180)
        assert probe.returncode == 0, out[-4000:]
        assert sink.wait(timeout=60) == 0
    finally:
        stop(probe)
        stop(sink)
    assert "label tag is not a number" in out and "skipped 32 rows" in out

    r = _run("probe", "--from", str(run_dir), *common, "--epochs", "1",
             "--out", str(tmp_path / "stored"),
             "--summary", str(tmp_path / "stored.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "skipped 32 rows" in r.stderr
    for name in ("live", "stored"):
        s = json.loads((tmp_path / f"{name}.json").read_text())
        assert s["data"]["bad_label_rows"] == PER, (name, s["data"])
        assert s["data"]["tokens/L0.post_block"] == 40 * REQS * PER - PER, name
        (saved,) = (tmp_path / name).glob("*/probe.json")
        assert _accuracy(load_probe(saved.parent)) > 0.95, name
