"""The one reader of probe and SAE checkpoints (``actbus.checkpoints``), on real files:
steering and monitors read a checkpoint alike, and a malformed one is a ``ConfigError``
naming the field for both (a monitor's reader used to fail with a ``JSONDecodeError``,
an ``AttributeError`` or an ``IndexError``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from actbus.checkpoints import PROBE_CFG, PROBE_WEIGHTS, SAE_CFG, SAE_WEIGHTS, read_probe
from actbus.errors import ConfigError
from actbus.monitor.config import MonitorConfig
from actbus.monitor.weights import load_weights
from actbus.steer.config import VectorSource
from actbus.steer.vectors import load_source

H = 8


def _probe(
    d: Path, heads: object = None, tensors: tuple[str, ...] = (), wrong: dict | None = None
) -> Path:
    d.mkdir()
    t = {
        "linear.weight": torch.randn(2, H),
        "linear.bias": torch.randn(2),
        "mean": torch.randn(H),
        "inv_std": torch.rand(H) + 0.5,
        **(wrong or {}),
    }
    save_file({k: v for k, v in t.items() if k not in tensors}, str(d / PROBE_WEIGHTS))
    heads = {"happy": 0, "sad": 1} if heads is None else heads
    (d / PROBE_CFG).write_text(json.dumps({"heads": heads, "actbus": {"kind": "linear"}}))
    return d


def _monitor(kind: str, path: Path, **kw):
    raw = {"monitors": {"m": {kind: str(path), "layers": [0], **kw}}}
    d = MonitorConfig.from_dict(raw).monitors["m"]
    return load_weights(d, H, "m")


def test_steering_and_a_monitor_read_one_probe_alike(tmp_path):
    d = _probe(tmp_path / "p")
    probe = read_probe(d, "p")
    assert probe.kind == "linear" and probe.row("sad", "p.head") == 1
    mw = _monitor("probe", d, head="sad")
    assert mw.activation == "linear"  # the probe's kind, read from its config
    steer = load_source(VectorSource("probe", str(d), head="sad"), "v")
    w = mw.weight[0].astype(np.float64)
    np.testing.assert_allclose(steer, w / np.linalg.norm(w), rtol=1e-5)


def test_a_malformed_checkpoint_is_refused_by_field_for_steering_and_monitors(tmp_path):
    bad = _probe(tmp_path / "heads", heads=["happy"])
    with pytest.raises(ConfigError, match=r"^m.probe: .*probe.json is not a probe's config$"):
        _monitor("probe", bad)
    with pytest.raises(ConfigError, match=r"^v.probe: .*probe.json is not a probe's config$"):
        load_source(VectorSource("probe", str(bad)), "v")
    rowless = _probe(tmp_path / "rowless", heads={"happy": 0, "sad": 5})
    with pytest.raises(ConfigError, match=r"^m.head: the probe's head 'sad' has no row"):
        _monitor("probe", rowless, head="sad")
    meanless = _probe(tmp_path / "meanless", tensors=("mean",))
    with pytest.raises(ConfigError, match=r"^m.probe.key: .* has no tensor 'mean'"):
        _monitor("probe", meanless, head="sad")
    misfit = _probe(tmp_path / "misfit", wrong={"mean": torch.zeros(H + 1)})
    with pytest.raises(ConfigError, match=r"^v.probe: .* do not fit together \(.*mean \[9\]"):
        load_source(VectorSource("probe", str(misfit), head="sad"), "v")
    sae = tmp_path / "sae"
    sae.mkdir()
    save_file({"W_enc": torch.randn(H, 4)}, str(sae / SAE_WEIGHTS))
    (sae / SAE_CFG).write_text("{not json")
    with pytest.raises(ConfigError, match=r"^m.sae: .*cfg.json is not an SAE's config$"):
        _monitor("sae", sae, features=[1])
    (sae / SAE_CFG).write_text(json.dumps({"architecture": "standard"}))
    with pytest.raises(ConfigError, match=r"^m.sae.key: .* has no tensor 'b_enc'"):
        _monitor("sae", sae, features=[1])
