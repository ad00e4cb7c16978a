"""SAE checkpoints in the layout SAELens loads: ``cfg.json`` + ``sae_weights.safetensors``.

``sae_weights.safetensors`` holds ``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec
[d_sae, d_in]``, ``b_dec`` (and ``threshold [d_sae]`` for jumprelu and batchtopk),
exactly as trained: they act on inputs multiplied by ``norm_scale`` (in cfg.json),
outputs divided by it. ``actbus_state.safetensors`` keeps what SAELens has no name
for (the scale as a tensor, the JumpReLU log-threshold, dead-latent counters), so
``load_sae`` rebuilds the module bit for bit. ``cfg.json`` carries SAELens' fields
and the whole actbus ``SAEConfig`` under ``actbus``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trainers.config import SAEConfig
from trainers.sae import SparseAutoencoder

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
STATE = "actbus_state.safetensors"
_ARCH = {"topk": "topk", "batchtopk": "batchtopk", "relu": "standard", "jumprelu": "jumprelu"}


def _cfg_json(sae: SparseAutoencoder, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    c = sae.cfg
    hook_name = f"blocks.{c.layer}.hook_resid_post" if c.hook == "post_block" else None
    out: dict[str, Any] = {
        "architecture": _ARCH[c.kind],
        "d_in": c.d_in,
        "d_sae": c.d_sae,
        "dtype": str(sae.W_enc.dtype).removeprefix("torch."),
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "model_name": model,
        "hook_name": hook_name or f"actbus.L{c.layer}.{c.hook}",
        "hook_layer": c.layer,
        "metadata": {"model_name": model, "hook_name": hook_name or f"L{c.layer}.{c.hook}"},
        "norm_scale": float(sae.norm_scale),
        "actbus": {**c.to_dict(), "norm_scale": float(sae.norm_scale), **extra},
    }
    if c.kind in ("topk", "batchtopk"):
        out["k"] = c.k
        out["activation_fn_str"] = "topk"
        out["activation_fn_kwargs"] = {"k": c.k}
    return out


def save_sae(
    sae: SparseAutoencoder, path: str | Path, *, model: str = "", extra: dict | None = None
) -> Path:
    """Write one SAE into directory ``path`` (made if missing); files replaced atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {
        "W_enc": sae.W_enc.detach(),
        "b_enc": sae.b_enc.detach(),
        "W_dec": sae.W_dec.detach(),
        "b_dec": sae.b_dec.detach(),
    }
    state = {
        "norm_scale": sae.norm_scale,
        "initialized": sae.initialized.to(torch.uint8),
        "batch_threshold": sae.threshold,
        "since_fired": sae.since_fired,
    }
    if sae.cfg.kind == "jumprelu":
        weights["threshold"] = sae.log_threshold.detach().exp()
        state["log_threshold"] = sae.log_threshold.detach()
    elif sae.cfg.kind == "batchtopk":
        weights["threshold"] = sae.threshold.expand(int(sae.cfg.d_sae))
    _save(weights, path / WEIGHTS)
    _save(state, path / STATE)
    tmp = path / (CFG + ".tmp")
    tmp.write_text(json.dumps(_cfg_json(sae, model, extra or {}), indent=2))
    os.replace(tmp, path / CFG)
    return path


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def load_sae(path: str | Path, device: str = "cpu") -> SparseAutoencoder:
    """A fresh module from a directory ``save_sae`` wrote."""
    path = Path(path)
    if not (path / CFG).exists():
        raise FileNotFoundError(f"{path}: no {CFG}; is this an SAE checkpoint directory?")
    cfg = SAEConfig.from_dict(json.loads((path / CFG).read_text())["actbus"])
    sae = SparseAutoencoder(cfg)
    w = load_file(str(path / WEIGHTS), device=device)
    s = load_file(str(path / STATE), device=device) if (path / STATE).exists() else {}
    with torch.no_grad():
        for k in ("W_enc", "b_enc", "W_dec", "b_dec"):
            getattr(sae, k).copy_(w[k])
        if "norm_scale" in s:
            sae.norm_scale.copy_(s["norm_scale"])
            sae.initialized.copy_(s["initialized"].bool())
            sae.threshold.copy_(s["batch_threshold"])
            sae.since_fired.copy_(s["since_fired"])
        else:  # weights from elsewhere: the scale from cfg.json
            sae.norm_scale.fill_(float(json.loads((path / CFG).read_text())["norm_scale"]))
            sae.initialized.fill_(True)
        if cfg.kind == "jumprelu":
            lt = s.get("log_threshold")
            sae.log_threshold.copy_(lt if lt is not None else w["threshold"].log())
    return sae.to(device)


def save_probe(probe, path: str | Path, *, metrics: dict[str, float] | None = None) -> Path:
    """A probe: ``probe.safetensors`` (weight, bias, standardisation) + ``probe.json``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _save({k: v.detach() for k, v in probe.state_dict().items()}, path / "probe.safetensors")
    tmp = path / "probe.json.tmp"
    tmp.write_text(json.dumps({"actbus": probe.cfg.to_dict(), "metrics": metrics or {}}, indent=2))
    os.replace(tmp, path / "probe.json")
    return path
