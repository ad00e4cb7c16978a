"""Trainers fed a hostile stream (issue 33): labels that overflow float32, rows near
3e38 and a width change mid-stream. A real publisher process, the real ``actbus run
probe`` and ``actbus run sae`` processes (together, one stream each), real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.procs import stop
from tests.support.trainer_synth import D, SynthPublisher
from trainers.checkpoint import CheckpointError, save_probe, save_sae
from trainers.config import ProbeConfig, SAEConfig
from trainers.data import ROW_LIMIT, finite_rows
from trainers.linear_probe import LinearProbe
from trainers.sae import SparseAutoencoder

ROOT = Path(__file__).resolve().parents[2]
MESSAGES, ROWS, REQS = 30, 256, 8
PER = ROWS // REQS


def _trainer(kind: str, address: str, out: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "run", kind, "--connect", address,
         "--layer", "0", "--d-in", str(D), "--batch-tokens", "256", "--buffer-tokens", "2048",
         "--warmup-tokens", "512", "--no-progress", "--policy", "block", "--idle-s", "10",
         "--out", str(out), "--summary", str(out.with_suffix(".json")), *flags],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_probe_and_sae_refuse_overflowing_labels_huge_rows_and_a_width_change(tmp_path):
    """Issue 33, MEDIUM 6 and LOW: label tags 1e308, 3.5e38 and "1e39" ended
    ``actbus run probe`` (rc 1); rows near 3e38 left a probe of NaN weights and an SAE
    that crashed while saving (``ZeroDivisionError``); rows 8 wider mid-stream were a
    raw shape error. Now each is refused and counted, and both save finite weights."""
    address = f"ipc://{tmp_path}/synth.sock"
    pub = SynthPublisher(
        address, MESSAGES, "--rows", str(ROWS), "--requests", str(REQS), "--label-shift", "1",
        "--wait-subscribers", "2", "--huge-every", "5", "--bad-labels-at", "3", "--wide-at", "7",
    )  # fmt: skip
    probe = _trainer("probe", address, tmp_path / "probe", "--label", "label", "--lr", "0.05")
    sae = _trainer("sae", address, tmp_path / "sae", "--k", "4", "--expansion", "4")
    try:
        outs = {name: p.communicate(timeout=240)[0] for name, p in (("probe", probe), ("sae", sae))}
    finally:
        for p in (probe, sae):
            stop(p)
        pub.stop()
    for name, p in (("probe", probe), ("sae", sae)):
        assert p.returncode == 0, (name, outs[name][-4000:])
    huge = 2 * len(range(0, MESSAGES, 5))  # two rows in each 5th message (step 7 is not one)
    for name in ("probe", "sae"):
        data = json.loads((tmp_path / f"{name}.json").read_text())["data"]
        assert data["nonfinite/L0.post_block"] == huge, (name, data)
        assert data["width_refused/L0.post_block"] == ROWS, (name, data)
        assert data["tokens/L0.post_block"] <= (MESSAGES - 1) * ROWS - huge
    probe_data = json.loads((tmp_path / "probe.json").read_text())["data"]
    assert probe_data["bad_label_rows"] == 3 * PER  # the three requests' rows, at step 3
    assert "label tag is not a number" in outs["probe"]
    (probe_file,) = (tmp_path / "probe").glob("*/probe.safetensors")
    (sae_file,) = (tmp_path / "sae").glob("*/sae_weights.safetensors")
    for f in (probe_file, sae_file):
        for k, v in load_file(str(f)).items():
            assert bool(torch.isfinite(v).all()), (f, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_beyond_the_limit_are_refused_like_nan_rows(dtype):
    x = torch.ones(5, 16, dtype=dtype)
    x[1, 3] = min(ROW_LIMIT, torch.finfo(dtype).max)  # at the limit (or fp16's max): kept
    x[2, 0] = float("inf") if dtype == torch.float16 else 3e38
    x[3, 15] = float("-inf") if dtype == torch.float16 else -1e10
    x[4, 7] = float("nan")
    assert finite_rows(x).tolist() == [True, True, False, False, False]


def test_checkpoints_refuse_nan_weights_and_a_zero_scale_by_name(tmp_path):
    """Nothing NaN is ever written, and an SAE whose scale is 0 (its first batch was
    too large to square) is refused by name, not a ZeroDivisionError."""
    probe = LinearProbe(ProbeConfig(d_in=D, labels=("label",)))
    with torch.no_grad():
        next(iter(probe.parameters())).fill_(float("nan"))
    with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
        save_probe(probe, tmp_path / "probe")
    assert not (tmp_path / "probe" / "probe.safetensors").exists()
    sae = SparseAutoencoder(SAEConfig(d_in=D, d_sae=64, kind="topk", k=4))
    sae.norm_scale.fill_(0.0)
    with pytest.raises(CheckpointError, match=r"input scale is 0\.0"):
        save_sae(sae, tmp_path / "sae")
