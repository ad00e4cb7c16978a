"""SAE checkpoints that SAELens loads as they are, and probe checkpoints.

An SAE directory holds ``cfg.json`` and ``sae_weights.safetensors`` in SAELens' own
(6.x) inference format, so ``sae_lens.SAE.load_from_disk(dir)`` gives the latents and
reconstructions of actbus's module on the stream's own (raw) activations:

- The input scale is folded into the weights. The module computes
  ``pre = (s*x - b_dec) @ W_enc + b_enc`` and ``x_hat = (z @ W_dec + b_dec) / s``; with
  ``W_enc' = s*W_enc``, ``W_dec' = W_dec/s`` and ``b_dec' = b_dec/s`` that is
  ``pre = (x - b_dec') @ W_enc' + b_enc`` and ``x_hat = z @ W_dec' + b_dec'``: SAELens'
  forward with ``normalize_activations: "none"``. The pre-activations are unchanged,
  so ``b_enc`` and every threshold (JumpReLU's, BatchTopK's) stay as trained.
- BatchTopK is stored as SAELens stores a trained BatchTopK for inference: a JumpReLU
  whose threshold (every latent alike) is the running threshold actbus encodes with.
- ``metadata`` names the model, the TransformerLens hook (``blocks.L.hook_resid_pre``,
  ``hook_resid_mid``, ``hook_mlp_out``, ``hook_resid_post``) and what is known of the
  data; ``metadata.actbus`` keeps actbus's whole ``SAEConfig`` and the scale.

``actbus_state.safetensors`` keeps what SAELens has no name for (the scale, the
JumpReLU log-threshold, the dead-latent counters), so ``load_sae`` rebuilds the
module: its weights are unfolded from the saved ones, so it computes what the trained
module did to float32 precision (rounding of one multiplication per weight).

A probe directory holds ``probe.safetensors`` (the linear head and the input
standardisation) and ``probe.json`` (its config, which head predicts which request
tag, and how to read the outputs); ``load_probe`` rebuilds it.

The file names and formats are ``actbus.checkpoints``', the one reader of them (for
steering sources and monitors); this module writes them, and rebuilds the modules.

A checkpoint is never written with a NaN or an infinity in it, nor with an SAE scale
that cannot be folded (zero or infinite): ``CheckpointError`` names the tensor instead,
and the previous checkpoint of that directory stays as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from actbus.checkpoints import (
    PROBE_CFG,
    PROBE_WEIGHTS,
    SAE_CFG,
    SAE_STATE,
    SAE_WEIGHTS,
    read_config,
    read_tensors,
    tl_hook_name,
)
from trainers.config import ProbeConfig, SAEConfig
from trainers.linear_probe import LinearProbe
from trainers.sae import SparseAutoencoder

SAE_LENS_FORMAT = "6.54.12"
"""The SAELens version whose config format ``cfg.json`` follows (loaded and checked
against it); written as ``metadata.sae_lens_version`` so SAELens reads the file as a
6.x config and keeps the metadata."""

# The inference architecture SAELens loads each kind as (each one of
# actbus.checkpoints.SAE_ARCHITECTURES, those the engine reads).
_ARCH = {"topk": "topk", "batchtopk": "jumprelu", "relu": "standard", "jumprelu": "jumprelu"}


def _metadata(sae: SparseAutoencoder, source: dict[str, Any], extra: dict) -> dict[str, Any]:
    """SAELens' metadata fields, those the stream tells us (model, longest sequence,
    the stored run); the rest are left out (SAELens reads them as None)."""
    c = sae.cfg
    meta: dict[str, Any] = {
        "sae_lens_version": SAE_LENS_FORMAT,
        "sae_lens_training_version": None,  # trained by actbus, not SAELens
        "model_name": source.get("model") or "",
        "hook_name": tl_hook_name(c.layer, c.hook),
        "hook_head_index": None,
        "model_from_pretrained_kwargs": {},
    }
    if source.get("context_size"):
        meta["context_size"] = int(source["context_size"])
    if source.get("dataset_path"):
        meta["dataset_path"] = str(source["dataset_path"])
    if c.kind == "batchtopk":
        meta["training_architecture"] = "batchtopk"
        meta["training_architecture_details"] = {"k": c.k}
    meta["actbus"] = {
        **c.to_dict(),
        "norm_scale": float(sae.norm_scale),
        "scale_folded": True,
        "source": source,
        **extra,
    }
    return meta


def _cfg_json(sae: SparseAutoencoder, source: dict[str, Any], extra: dict) -> dict[str, Any]:
    c = sae.cfg
    out: dict[str, Any] = {
        "architecture": _ARCH[c.kind],
        "d_in": c.d_in,
        "d_sae": int(c.d_sae),
        "dtype": str(sae.W_enc.dtype).removeprefix("torch."),
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
    }
    if c.kind == "topk":
        out["k"] = c.k
        out["rescale_acts_by_decoder_norm"] = False
    out["metadata"] = _metadata(sae, source, extra)
    return out


class CheckpointError(ValueError):
    """What would be saved is not a usable model (NaN weights, a zero scale)."""


@torch.no_grad()
def folded_weights(sae: SparseAutoencoder) -> dict[str, torch.Tensor]:
    """The weights acting on raw activations (SAELens' names), computed in float64 and
    rounded once to the weights' dtype."""
    s = float(sae.norm_scale)
    if not (s > 0 and s < float("inf")):
        raise CheckpointError(
            f"the SAE's input scale is {s}: its first batch's rows were zero or too large "
            "to square; nothing saved (train on rows of the stream's usual size)"
        )
    dtype = sae.W_enc.dtype

    def f(t: torch.Tensor, factor: float) -> torch.Tensor:
        return (t.detach().double() * factor).to(dtype)

    out = {
        "W_enc": f(sae.W_enc, s),
        "b_enc": sae.b_enc.detach().clone(),
        "W_dec": f(sae.W_dec, 1.0 / s),
        "b_dec": f(sae.b_dec, 1.0 / s),
    }
    if sae.cfg.kind == "jumprelu":
        out["threshold"] = sae.log_threshold.detach().exp()  # exactly the module's theta
    elif sae.cfg.kind == "batchtopk":
        # Never trained (no threshold yet): 0, i.e. a plain ReLU.
        t = sae.threshold.detach().clamp_min(0.0).to(dtype)
        out["threshold"] = t.expand(int(sae.cfg.d_sae))
    return out


def save_sae(
    sae: SparseAutoencoder,
    path: str | Path,
    *,
    model: str = "",
    source: dict[str, Any] | None = None,
    extra: dict | None = None,
) -> Path:
    """Write one SAE into directory ``path`` (made if missing); files replaced atomically.

    ``source``: what the stream told about the data (``model``, ``context_size``,
    ``dataset_path``, ...; ``ActivationDataModule.stream_info()``); ``model`` overrides
    its model name."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = dict(source or {})
    if model:
        source["model"] = model
    state = {
        "norm_scale": sae.norm_scale,
        "initialized": sae.initialized.to(torch.uint8),
        "batch_threshold": sae.threshold,
        "since_fired": sae.since_fired,
    }
    if sae.cfg.kind == "jumprelu":
        state["log_threshold"] = sae.log_threshold.detach()
    weights = folded_weights(sae)
    _check_finite(weights, path / SAE_WEIGHTS)
    _check_finite(state, path / SAE_STATE)
    _save(weights, path / SAE_WEIGHTS)
    _save(state, path / SAE_STATE)
    _write_json(path / SAE_CFG, _cfg_json(sae, source, extra or {}))
    return path


def _check_finite(tensors: dict[str, torch.Tensor], path: Path) -> None:
    for k, v in tensors.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(
                f"{path}: {k} holds NaN or infinite values (training diverged: a smaller "
                "--lr, or rows of a usual size); nothing saved, the previous files stay"
            )


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in read_tensors(path, str(path.parent)).items()}


def load_sae(path: str | Path, device: str = "cpu") -> SparseAutoencoder:
    """A fresh module from a directory ``save_sae`` wrote (the scale unfolded again)."""
    path = Path(path)
    raw = read_config(path, str(path), "sae")
    # Checkpoints written before the scale was folded kept actbus's fields at the top.
    meta = raw.get("metadata")
    meta = (meta.get("actbus") if isinstance(meta, dict) else None) or raw.get("actbus")
    if not isinstance(meta, dict):
        raise ValueError(f"{path / SAE_CFG}: no actbus metadata; not written by actbus's save_sae")
    cfg = SAEConfig.from_dict(meta)
    sae = SparseAutoencoder(cfg)
    w = _read_tensors(path / SAE_WEIGHTS)
    s = _read_tensors(path / SAE_STATE) if (path / SAE_STATE).exists() else {}
    for k in ("W_enc", "W_dec", "b_enc", "b_dec"):
        if k not in w or w[k].shape != getattr(sae, k).shape:
            got = list(w[k].shape) if k in w else "missing"
            raise ValueError(
                f"{path / SAE_WEIGHTS}: {k} is {got}, its config's SAE has "
                f"{list(getattr(sae, k).shape)}; the files are of two different SAEs"
            )
    scale = float(s["norm_scale"]) if "norm_scale" in s else float(meta["norm_scale"])
    unfold = bool(meta.get("scale_folded"))
    with torch.no_grad():
        for k, factor in (("W_enc", 1.0 / scale), ("W_dec", scale), ("b_dec", scale)):
            t = w[k].double() * factor if unfold else w[k]
            getattr(sae, k).copy_(t.to(sae.W_enc.dtype))
        sae.b_enc.copy_(w["b_enc"])
        sae.norm_scale.fill_(scale)
        sae.initialized.fill_(True)
        if "since_fired" in s:
            sae.threshold.copy_(s["batch_threshold"])
            sae.since_fired.copy_(s["since_fired"])
        elif cfg.kind == "batchtopk":
            sae.threshold.copy_(w["threshold"][0])
        if cfg.kind == "jumprelu":
            lt = s.get("log_threshold")
            sae.log_threshold.copy_(lt if lt is not None else w["threshold"].log())
    return sae.to(device)


def save_probe(
    probe: LinearProbe,
    path: str | Path,
    *,
    metrics: dict[str, float] | None = None,
    source: dict[str, Any] | None = None,
) -> Path:
    """A probe: ``probe.safetensors`` (head, standardisation) + ``probe.json`` (its config,
    the head of each label tag, held-out metrics, and what the stream told: ``source``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = probe.cfg
    reads = (
        "logit of P(tag value == 1); labels are 0/1 (or false/true)"
        if c.kind == "logistic"
        else "the predicted tag value"
    )
    weights = {k: v.detach() for k, v in probe.state_dict().items()}
    _check_finite(weights, path / PROBE_WEIGHTS)
    _save(weights, path / PROBE_WEIGHTS)
    meta = {
        "actbus": c.to_dict(),
        "heads": {tag: i for i, tag in enumerate(c.labels)},
        "output": reads,
        "hook_name": tl_hook_name(c.layer, c.hook),
        "source": dict(source or {}),
        "metrics": metrics or {},
    }
    _write_json(path / PROBE_CFG, meta)
    return path


def load_probe(path: str | Path, device: str = "cpu") -> LinearProbe:
    """A fresh ``LinearProbe`` from a directory ``save_probe`` wrote; ``probe.cfg.labels[i]``
    is the tag head ``i`` predicts."""
    path = Path(path)
    meta = read_config(path, str(path), "probe")
    known = {f.name for f in dataclasses.fields(ProbeConfig)}
    probe = LinearProbe(ProbeConfig(**{k: v for k, v in meta["actbus"].items() if k in known}))
    probe.load_state_dict(_read_tensors(path / PROBE_WEIGHTS))
    return probe.to(device).eval()
