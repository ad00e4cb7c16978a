"""A monitor's weights, from raw values or from probe and SAE checkpoints.

Every monitor becomes the same form: ``cols`` linear scores ``pre = W x + b`` of the
raw stream, then an activation per monitor. Checkpoints are read through
``actbus.checkpoints``, the one reader of the formats ``trainers/checkpoint.py`` (and,
for SAEs, SAELens' ``save_model``) write:

- a probe head ``h`` reads ``linear((x - mean) * inv_std)[h]``: on the raw stream that is
  ``w = W[h] * inv_std`` and ``b = bias[h] - w . mean``; a logistic probe's reading is a
  probability (sigmoid), unless the monitor sets ``sigmoid``;
- SAE latents read ``(x - b_dec) @ W_enc + b_enc`` (SAELens' form, the input scale
  already folded in): ``w = W_enc[:, f]`` and ``b = b_enc[f] - b_dec . W_enc[:, f]``
  (both times ``||W_dec[f]||`` for a TopK SAE with ``rescale_acts_by_decoder_norm``),
  then ReLU, JumpReLU (``pre * (pre > threshold)``, the threshold at least 0) or TopK:
  SAELens' own ``encode``, for checkpoints SAELens saved as for those actbus's
  trainers write. TopK needs every latent to know which are in the top ``k``, so a
  TopK monitor's columns are the whole encoder, and only the chosen features are
  published.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actbus.checkpoints import read_probe, read_sae_encoder
from actbus.errors import ConfigError
from actbus.monitor.config import MonitorDef

ACTIVATIONS = ("linear", "sigmoid", "relu", "jumprelu", "topk")
_ACTIVATION = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}
"""A monitor's activation for each SAE architecture (``actbus.checkpoints``)."""


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
        mw = _sae(d, where, hidden)
    mw.check(hidden, where)
    return mw


def _probe(d: MonitorDef, where: str) -> MonitorWeights:
    probe = read_probe(Path(d.path or "").expanduser(), f"{where}.probe")
    h = probe.row(d.head, f"{where}.head")
    w = probe.weight[h].astype(np.float64) * probe.inv_std.astype(np.float64)
    b = float(probe.bias[h]) - float(w @ probe.mean.astype(np.float64))
    sigmoid = probe.kind == "logistic" if d.sigmoid is None else d.sigmoid
    return MonitorWeights(
        w.astype(np.float32)[None, :],
        np.array([b], dtype=np.float32),
        "sigmoid" if sigmoid else "linear",
        np.zeros(1, dtype=np.float32),
        published=(0,),
    )


def _sae(d: MonitorDef, where: str, hidden: int) -> MonitorWeights:
    sae = read_sae_encoder(Path(d.path or "").expanduser(), f"{where}.sae")
    d_sae = sae.d_sae
    if sae.d_in != hidden:
        model = sae.info.model_name if sae.info is not None else None
        raise ConfigError(
            f"{where}.sae: the SAE reads {sae.d_in}-wide rows; this model's residual stream "
            f"has {hidden}: it was made for another model"
            + (f" ({model!r}, its cfg.json)" if model else "")
        )
    for i, f in enumerate(d.features):
        if f >= d_sae:
            raise ConfigError(
                f"{where}.features[{i}]: latent {f} is out of range; the SAE has {d_sae} latents"
            )
    arch = _ACTIVATION[sae.architecture]
    w_enc = sae.W_enc.astype(np.float64)  # [d_in, d_sae]
    b_dec = sae.b_dec.astype(np.float64)
    theta = sae.threshold.astype(np.float64) if sae.threshold is not None else np.zeros(d_sae)
    cols = np.arange(d_sae) if arch == "topk" else np.asarray(d.features, dtype=np.int64)
    w = w_enc[:, cols].T
    b = sae.b_enc.astype(np.float64)[cols] - b_dec @ w_enc[:, cols]
    if sae.latent_scale is not None:  # SAELens ranks and returns pre * ||W_dec[f]||
        w = w * sae.latent_scale.astype(np.float64)[cols, None]
        b = b * sae.latent_scale.astype(np.float64)[cols]
    published = tuple(d.features) if arch == "topk" else tuple(range(len(cols)))
    return MonitorWeights(
        np.ascontiguousarray(w, dtype=np.float32),
        b.astype(np.float32),
        arch,
        theta[cols].astype(np.float32),
        k=sae.k,
        published=published,
        labels=tuple(d.features),
    )
