"""A monitor's weights, from raw values or from the checkpoints actbus's trainers write.

Every monitor becomes the same form: ``cols`` linear scores ``pre = W x + b`` of the
raw stream, then an activation per monitor. Checkpoints are read in the file formats
of ``trainers/checkpoint.py`` without importing trainers:

- a probe head ``h`` reads ``linear((x - mean) * inv_std)[h]``: on the raw stream that is
  ``w = W[h] * inv_std`` and ``b = bias[h] - w . mean``; a logistic probe's reading is a
  probability (sigmoid), unless the monitor sets ``sigmoid``;
- SAE latents read ``(x - b_dec) @ W_enc + b_enc`` (SAELens' form, the input scale
  already folded in): ``w = W_enc[:, f]`` and ``b = b_enc[f] - b_dec . W_enc[:, f]``,
  then ReLU, JumpReLU (``pre * (pre > threshold)``) or TopK. TopK needs every latent
  to know which are in the top ``k``, so a TopK monitor's columns are the whole
  encoder, and only the chosen features are published.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actbus.errors import ConfigError
from actbus.monitor.config import MonitorDef
from actbus.steer.vectors import PROBE_CFG, PROBE_WEIGHTS, SAE_WEIGHTS, _tensor

SAE_CFG = "cfg.json"
ACTIVATIONS = ("linear", "sigmoid", "relu", "jumprelu", "topk")
_SAE_ARCH = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}


@dataclass(frozen=True, eq=False)
class MonitorWeights:
    """What the device tables hold for one monitor (float32)."""

    weight: np.ndarray  # [cols, hidden]
    bias: np.ndarray  # [cols]
    activation: str  # one of ACTIVATIONS
    theta: np.ndarray  # [cols]: JumpReLU thresholds (zeros otherwise)
    k: int = 0  # TopK: latents kept per token
    published: tuple[int, ...] = ()
    """Columns whose scores are published, in order (TopK: the chosen features)."""
    labels: tuple[int, ...] = ()
    """What each published column is: SAE latent indices; empty for a probe."""

    @property
    def cols(self) -> int:
        return int(self.weight.shape[0])

    @property
    def width(self) -> int:
        return len(self.published)

    def check(self, hidden: int, where: str) -> None:
        """Shapes and values a table can take: the model's width, finite numbers."""
        if self.weight.ndim != 2 or self.weight.shape[1] != hidden:
            raise ConfigError(
                f"{where}: the weights are {list(self.weight.shape)} wide; this model's "
                f"residual stream has {hidden}"
            )
        if self.bias.shape != (self.cols,) or self.theta.shape != (self.cols,):
            raise ConfigError(
                f"{where}: bias/threshold must have one value per column ({self.cols})"
            )
        for what, a in (("weights", self.weight), ("bias", self.bias), ("threshold", self.theta)):
            if not np.isfinite(a).all():
                raise ConfigError(f"{where}: the {what} hold NaN or Inf values")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"{where}: unknown activation {self.activation!r}")
        if self.activation == "topk" and not 0 < self.k <= self.cols:
            raise ConfigError(f"{where}: k={self.k} is not in 1..{self.cols}")


def load_weights(d: MonitorDef, hidden: int, where: str) -> MonitorWeights:
    """The weights of monitor ``d`` for a model of width ``hidden``, checked."""
    if d.kind == "weight":
        w = np.asarray(d.weight, dtype=np.float32).reshape(1, -1)
        mw = MonitorWeights(
            w,
            np.array([d.bias], dtype=np.float32),
            "sigmoid" if d.sigmoid else "linear",
            np.zeros(1, dtype=np.float32),
            published=(0,),
        )
    elif d.kind == "probe":
        mw = _probe(d, where)
    else:
        mw = _sae(d, where)
    mw.check(hidden, where)
    return mw


def _probe(d: MonitorDef, where: str) -> MonitorWeights:
    path = Path(d.path or "").expanduser()
    cfg_path = path / PROBE_CFG
    if not cfg_path.is_file():
        raise ConfigError(f"{where}.probe: {path} has no {PROBE_CFG}; is it a probe checkpoint?")
    meta = json.loads(cfg_path.read_text())
    heads: dict[str, int] = meta.get("heads", {})
    head = d.head
    if head is None:
        if len(heads) != 1:
            raise ConfigError(f"{where}.head: the probe has heads {sorted(heads)}; name one")
        head = next(iter(heads))
    if head not in heads:
        raise ConfigError(f"{where}.head: the probe has no head {head!r}; it has {sorted(heads)}")
    files = path / PROBE_WEIGHTS
    weight = _tensor(files, "linear.weight", f"{where}.probe").astype(np.float64)
    bias = _tensor(files, "linear.bias", f"{where}.probe").astype(np.float64)
    mean = _tensor(files, "mean", f"{where}.probe").astype(np.float64)
    inv_std = _tensor(files, "inv_std", f"{where}.probe").astype(np.float64)
    h = heads[head]
    w = weight[h] * inv_std
    b = bias[h] - float(w @ mean)
    logistic = (meta.get("actbus") or {}).get("kind", "logistic") == "logistic"
    sigmoid = logistic if d.sigmoid is None else d.sigmoid
    return MonitorWeights(
        w.astype(np.float32)[None, :],
        np.array([b], dtype=np.float32),
        "sigmoid" if sigmoid else "linear",
        np.zeros(1, dtype=np.float32),
        published=(0,),
    )


def _sae(d: MonitorDef, where: str) -> MonitorWeights:
    path = Path(d.path or "").expanduser()
    cfg_path = path / SAE_CFG
    if not cfg_path.is_file():
        raise ConfigError(f"{where}.sae: {path} has no {SAE_CFG}; is it an SAE checkpoint?")
    cfg = json.loads(cfg_path.read_text())
    arch = _SAE_ARCH.get(cfg.get("architecture"))
    if arch is None:
        raise ConfigError(
            f"{where}.sae: architecture {cfg.get('architecture')!r} is not one a monitor "
            f"reads (valid: {', '.join(_SAE_ARCH)})"
        )
    if cfg.get("normalize_activations", "none") != "none":
        raise ConfigError(f"{where}.sae: normalize_activations must be 'none' (actbus folds it)")
    files = path / SAE_WEIGHTS
    w_enc = _tensor(files, "W_enc", f"{where}.sae").astype(np.float64)  # [d_in, d_sae]
    b_enc = _tensor(files, "b_enc", f"{where}.sae").astype(np.float64)
    b_dec = _tensor(files, "b_dec", f"{where}.sae").astype(np.float64)
    d_sae = w_enc.shape[1]
    for i, f in enumerate(d.features):
        if f >= d_sae:
            raise ConfigError(
                f"{where}.features[{i}]: latent {f} is out of range; the SAE has {d_sae} latents"
            )
    if not cfg.get("apply_b_dec_to_input", True):
        b_dec = np.zeros_like(b_dec)
    theta = (
        _tensor(files, "threshold", f"{where}.sae").astype(np.float64)
        if arch == "jumprelu"
        else np.zeros(d_sae)
    )
    cols = np.arange(d_sae) if arch == "topk" else np.asarray(d.features, dtype=np.int64)
    w = w_enc[:, cols].T
    b = b_enc[cols] - b_dec @ w_enc[:, cols]
    published = tuple(d.features) if arch == "topk" else tuple(range(len(cols)))
    return MonitorWeights(
        np.ascontiguousarray(w, dtype=np.float32),
        b.astype(np.float32),
        arch,
        theta[cols].astype(np.float32),
        k=int(cfg.get("k", 0) or 0) if arch == "topk" else 0,
        published=published,
        labels=tuple(d.features),
    )
