"""``actbus serve`` refuses, before vLLM starts, what the model's config.json and the
sources' files already rule out: one line, exit status 2, no traceback (these took
21-42 s, under a traceback of about 45 lines that ended "told 0 subscriber(s)"). A
source SAE or probe trained on another model is warned about, naming both. Real files:
a model directory with its config.json, SAE and probe checkpoints' configs and
safetensors files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from actbus.config import CaptureConfig
from actbus.precheck import model_shape, precheck
from actbus.serve import main as serve_main
from tests.support.procs import ROOT

HIDDEN = 128


def _model(tmp_path: Path, arch: str = "LlamaForCausalLM") -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    raw = {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": HIDDEN}
    (d / "config.json").write_text(json.dumps({**raw, "_name_or_path": "org/tiny-llama"}))
    return d


def _sae(tmp_path: Path, trained_on: str, width: int = HIDDEN, name: str = "sae") -> Path:
    d = tmp_path / name
    d.mkdir()
    w = np.ones((width, 16), dtype=np.float32)
    zeros = np.zeros(16, np.float32), np.zeros(width, np.float32)
    tensors = {"W_enc": w, "W_dec": w.T.copy(), "b_enc": zeros[0], "b_dec": zeros[1]}
    save_file(tensors, str(d / "sae_weights.safetensors"))
    (d / "cfg.json").write_text(json.dumps({"model_name": trained_on, "architecture": "standard"}))
    return d


def test_a_layer_out_of_range_is_one_line_before_the_engine(tmp_path):
    """As a user runs it: exit status 2, one line naming the field and the model's
    layers, no traceback, and no server started (nothing else is said)."""
    r = subprocess.run(
        [sys.executable, "-m", "actbus.cli", "serve", str(_model(tmp_path)), "--layers", "1,9"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"actbus serve: actbus.layers[1]: layer 9 is out of range; model {tmp_path}/model has "
        "4 decoder layers (valid: 0..3)"
    ]


def _refused(capsys, argv: list[str]) -> str:
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


def test_what_config_json_and_the_sources_rule_out_is_refused_by_name(tmp_path, capsys):
    model = str(_model(tmp_path))
    minicpm = tmp_path / "minicpm"
    minicpm.mkdir()
    (minicpm / "config.json").write_text(
        json.dumps(
            {"architectures": ["MiniCPMForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8}
        )
    )
    assert "architecture MiniCPMForCausalLM is not supported for capture" in _refused(
        capsys, [str(minicpm), "--layers", "0"]
    )
    monitor = {"monitor": {"monitors": {"m": {"weight": [0.5] * 64, "layers": [1]}}}}
    assert _refused(capsys, [model, "--layers", "1", "--actbus-config", json.dumps(monitor)]) == (
        "actbus serve: actbus.monitor.monitors.m: the weights are 64 wide; this model's "
        "residual stream has 128"
    )
    monitor["monitor"]["monitors"]["m"] = {"weight": [0.5] * HIDDEN, "layers": [7]}
    assert "actbus.monitor.monitors.m.layers[0]: layer 7 is out of range" in _refused(
        capsys, [model, "--layers", "1", "--actbus-config", json.dumps(monitor)]
    )
    save_file({"v": np.ones(96, np.float32)}, str(tmp_path / "v.safetensors"))
    steer = {"steer": {"layers": [1], "vectors": {"v": {"file": str(tmp_path / "v.safetensors")}}}}
    assert _refused(capsys, [model, "--layers", "1", "--actbus-config", json.dumps(steer)]) == (
        "actbus serve: actbus.steer.vectors.v: has 96 values; this model's residual stream has 128"
    )
    sae = _sae(tmp_path, "meta-llama/Llama-3-8B", width=64)
    steer = {"steer": {"layers": [1], "vectors": {"f": {"sae": str(sae), "feature": 3}}}}
    assert _refused(capsys, [model, "--layers", "1", "--actbus-config", json.dumps(steer)]) == (
        "actbus serve: actbus.steer.vectors.f: has 64 values; this model's residual stream has 128"
    )


@pytest.mark.parametrize("where", ["steer", "monitor"])
def test_a_source_sae_of_another_model_is_warned_about_naming_both(tmp_path, where):
    """Its width matches, so it is taken; the warning names the model it was trained on
    and the one served (it was accepted with no word). One of the served model's own
    names (its hub id, here config.json's ``_name_or_path``) raises none."""
    model = _model(tmp_path)
    other = _sae(tmp_path, "meta-llama/Llama-3-8B")
    own = _sae(tmp_path, "org/tiny-llama", name="own")
    if where == "steer":
        vectors = {"f": {"sae": str(other), "feature": 3}, "g": {"sae": str(own), "feature": 1}}
        raw = {"vectors": vectors}
        cfg = CaptureConfig.from_dict({"layers": [1], "steer": {"layers": [1], **raw}})
        name = "actbus.steer.vectors.f"
    else:
        sae = {"layers": [1], "features": [3]}
        monitors = {"f": {"sae": str(other), **sae}, "g": {"sae": str(own), **sae}}
        cfg = CaptureConfig.from_dict({"layers": [1], "monitor": {"monitors": monitors}})
        name = "actbus.monitor.monitors.f"
    warnings = precheck(cfg, model_shape(str(model)))
    assert warnings == [
        f"{name}: the sae at {other} was trained on 'meta-llama/Llama-3-8B' (its cfg.json), "
        f"but the model served is {str(model)!r}; its directions may mean nothing in this "
        "model's stream"
    ]
