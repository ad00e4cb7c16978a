"""The probe and SAE checkpoint formats: their file names, and the one reader of them.

``trainers/checkpoint.py`` writes them (``actbus run sae``, ``actbus run probe``) with
the names below; steering sources (``actbus.steer.vectors``), monitors
(``actbus.monitor.weights``) and ``actbus serve``'s precheck read them here, without
importing trainers. A checkpoint is a file like any peer's: every tensor is refused
from its header when it is too big, a config when it is over ``MAX_CFG_BYTES`` or not
of the form written, and each refusal names the field.

- An SAE directory holds ``cfg.json`` and ``sae_weights.safetensors`` in SAELens'
  (6.x) inference format, the input scale folded into the weights: latents read
  ``(x - b_dec) @ W_enc + b_enc`` of the raw stream (``b_dec`` only with
  ``apply_b_dec_to_input``), then ReLU (``standard``), JumpReLU (``threshold``) or TopK
  (``k``); the decoder rows ``W_dec[f]`` are the latents' directions.
  ``actbus_state.safetensors`` keeps what SAELens has no name for (training state).
- A probe directory holds ``probe.safetensors`` (``linear.weight``, ``linear.bias``,
  ``mean``, ``inv_std``) and ``probe.json`` (``heads``: which row predicts which tag;
  ``actbus.kind``: logistic or linear). Head ``h`` reads
  ``linear((x - mean) * inv_std)[h]``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actbus.errors import ConfigError

SAE_CFG = "cfg.json"
SAE_WEIGHTS = "sae_weights.safetensors"
SAE_STATE = "actbus_state.safetensors"
PROBE_CFG = "probe.json"
PROBE_WEIGHTS = "probe.safetensors"
PROBE_TENSORS = ("linear.weight", "linear.bias", "mean", "inv_std")
"""A probe's tensors, in ``Probe``'s order (a ``LinearProbe``'s state dict holds them)."""
SAE_ARCHITECTURES = ("standard", "jumprelu", "topk")
"""SAELens' inference architectures, those actbus writes and reads."""

MAX_TENSOR_BYTES = 256 << 20
"""The largest tensor a path source may name (an SAE's decoder of 65k latents x 1024
is 256 MiB in float32): a bigger one is refused from its header, before it is read."""
MAX_CFG_BYTES = 1 << 20
"""The largest checkpoint config read (those actbus writes are a few KiB)."""


class Confine:
    """The directories path sources may be read from (``actbus.steer.vector_dirs``):
    a path counts once every link in it is followed. Outside them nothing is opened,
    and the refusal is the same whether or not the file exists."""

    def __init__(self, dirs: tuple[str, ...]) -> None:
        self.dirs = tuple(Path(os.path.realpath(d)) for d in dirs)

    def __call__(self, path: Path, where: str) -> Path:
        real = Path(os.path.realpath(path))
        if not any(real == d or d in real.parents for d in self.dirs):
            raise ConfigError(
                f"{where}: not under the server's vector directories; paths must lie in one "
                "of actbus.steer.vector_dirs (links followed)"
                if self.dirs
                else f"{where}: this server reads no vector files for HTTP callers; list the "
                "directories they may use in actbus.steer.vector_dirs"
            )
        return real


def _open(path: Path, where: str, confine: Confine | None) -> Path:
    return confine(path, where) if confine is not None else path


def read_tensor(
    path: Path, key: str | None, where: str, confine: Confine | None = None
) -> np.ndarray:
    """Tensor ``key`` of a safetensors file as float32 (``None``: the file's only one),
    refused from the header when over ``MAX_TENSOR_BYTES``. With ``confine`` the file
    is opened only inside its directories, and errors do not list the file's tensors."""
    from safetensors import safe_open

    path = _open(path, where, confine)
    if not path.is_file():
        raise ConfigError(f"{where}: {path} is not a file")
    try:
        f_ = safe_open(str(path), framework="pt")
    except Exception as e:  # not a safetensors file: say so, not how it failed inside
        raise ConfigError(
            f"{where}: {path} is not a safetensors file ({type(e).__name__})"
        ) from None
    with f_ as f:
        keys = list(f.keys())
        if key is None:
            if len(keys) != 1:
                raise ConfigError(
                    f"{where}.key: {path} holds {len(keys)} tensors; name the tensor to use"
                    + (f" (it holds {keys[:20]})" if confine is None else "")
                )
            key = keys[0]
        if key not in keys:
            raise ConfigError(
                f"{where}.key: {path} has no tensor {key!r:.100}"
                + (f"; it holds {keys[:20]}" if confine is None else "")
            )
        sl = f.get_slice(key)
        size = int(np.prod(sl.get_shape(), dtype=np.int64)) * 4  # read as float32
        if size > MAX_TENSOR_BYTES:
            raise ConfigError(
                f"{where}.key: tensor {key!r:.100} is {size} bytes as float32, more than the "
                f"{MAX_TENSOR_BYTES} a vector source may read"
            )
        return f.get_tensor(key).float().numpy()


def tensor_shapes(path: Path, where: str) -> dict[str, list[int]]:
    """Each tensor's shape in a safetensors file, from its header alone."""
    if not path.is_file():
        raise ConfigError(f"{where}: {path} is not a file")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise ConfigError(f"{where}: {path} is not a safetensors file ({e})") from None


def _cfg(path: Path, where: str, what: str, confine: Confine | None) -> tuple[dict[str, Any], Path]:
    """A checkpoint's JSON config (``what``: "a probe", "an SAE"), bounded and a mapping,
    with the path it was read from."""
    name = PROBE_CFG if what == "a probe" else SAE_CFG
    cfg_path = _open(path / name, where, confine)
    if not cfg_path.is_file():
        raise ConfigError(f"{where}: {path} has no {name}; is it {what} checkpoint?")
    if cfg_path.stat().st_size > MAX_CFG_BYTES:
        raise ConfigError(
            f"{where}: {cfg_path} is over {MAX_CFG_BYTES >> 20} MiB; not {what}'s config"
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except (ValueError, RecursionError):
        raw = None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {cfg_path} is not {what}'s config")
    return raw, cfg_path


@dataclass(frozen=True, eq=False)
class Probe:
    """A probe checkpoint: one row of ``weight`` and ``bias`` per head (float32)."""

    heads: dict[str, int]
    """Label tag -> the row of ``weight`` that predicts it."""
    kind: str
    """``logistic`` (a head reads a logit) or ``linear`` (the predicted value)."""
    weight: np.ndarray  # [heads, d_in]
    bias: np.ndarray  # [heads]
    mean: np.ndarray  # [d_in]
    inv_std: np.ndarray  # [d_in]

    def row(self, head: str | None, where: str) -> int:
        """The row of head ``head`` (None: the probe's only head); ``where`` names the
        field that chose it."""
        if head is None:
            if len(self.heads) != 1:
                raise ConfigError(f"{where}: the probe has heads {sorted(self.heads)}; name one")
            head = next(iter(self.heads))
        if head not in self.heads:
            raise ConfigError(
                f"{where}: the probe has no head {head!r}; it has {sorted(self.heads)}"
            )
        if self.heads[head] >= len(self.weight):
            raise ConfigError(f"{where}: the probe's head {head!r} has no row in its weights")
        return self.heads[head]


def read_probe(path: Path, where: str, confine: Confine | None = None) -> Probe:
    """The probe checkpoint in directory ``path`` (``where``: the field naming it)."""
    meta, cfg_path = _cfg(path, where, "a probe", confine)
    heads = meta.get("heads", {})
    own = meta.get("actbus") or {}
    kind = own.get("kind", "logistic") if isinstance(own, dict) else None
    if not (
        isinstance(heads, dict)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in heads.values())
        and isinstance(kind, str)
    ):
        raise ConfigError(f"{where}: {cfg_path} is not a probe's config")
    files = path / PROBE_WEIGHTS
    t = {k: read_tensor(files, k, where, confine) for k in PROBE_TENSORS}
    d_in = t["mean"].shape
    if t["linear.weight"].shape[-1:] != d_in or t["inv_std"].shape != d_in or len(d_in) != 1:
        _misfit(t, files, where)
    if t["linear.weight"].ndim != 2 or t["linear.bias"].shape != t["linear.weight"].shape[:1]:
        _misfit(t, files, where)
    return Probe(heads, kind, *t.values())


def _misfit(tensors: dict[str, np.ndarray], path: Path, where: str) -> None:
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    raise ConfigError(f"{where}: the tensors of {path} do not fit together ({shapes})")


@dataclass(frozen=True, eq=False)
class SAEEncoder:
    """What an SAE checkpoint scores latents with (float32, SAELens' names)."""

    architecture: str  # one of SAE_ARCHITECTURES
    k: int
    """TopK: latents kept per token (0 otherwise)."""
    W_enc: np.ndarray  # [d_in, d_sae]
    b_enc: np.ndarray  # [d_sae]
    b_dec: np.ndarray  # [d_in]: zeros unless apply_b_dec_to_input
    threshold: np.ndarray | None  # [d_sae]: JumpReLU only

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])


def read_sae_encoder(path: Path, where: str) -> SAEEncoder:
    """The encoder of the SAE checkpoint in directory ``path``, as a monitor reads it:
    ``cfg.json`` first (architecture, ``k``, the input's handling), then the tensors."""
    cfg, cfg_path = _cfg(path, where, "an SAE", None)
    arch = cfg.get("architecture")
    if arch not in SAE_ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {arch!r} is not one a monitor "
            f"reads (valid: {', '.join(SAE_ARCHITECTURES)})"
        )
    if cfg.get("normalize_activations", "none") != "none":
        raise ConfigError(f"{where}: normalize_activations must be 'none' (actbus folds it)")
    files = path / SAE_WEIGHTS
    w_enc = read_tensor(files, "W_enc", where)
    b_enc = read_tensor(files, "b_enc", where)
    b_dec = read_tensor(files, "b_dec", where)
    if not cfg.get("apply_b_dec_to_input", True):
        b_dec = np.zeros_like(b_dec)
    try:
        k = int(cfg.get("k", 0) or 0) if arch == "topk" else 0
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: k in {cfg_path} is not an integer") from None
    t = {"W_enc": w_enc, "b_enc": b_enc, "b_dec": b_dec}
    if arch == "jumprelu":
        t["threshold"] = read_tensor(files, "threshold", where)
    if w_enc.ndim != 2 or b_enc.shape != w_enc.shape[1:] or b_dec.shape != w_enc.shape[:1]:
        _misfit(t, files, where)
    if arch == "jumprelu" and t["threshold"].shape != b_enc.shape:
        _misfit(t, files, where)
    return SAEEncoder(arch, k, w_enc, b_enc, b_dec, t.get("threshold"))


def read_sae_decoder(path: Path, where: str, confine: Confine | None = None) -> np.ndarray:
    """The decoder ``W_dec`` [d_sae, d_in] of the SAE checkpoint in directory ``path``:
    its rows are the latents' directions (no config needed)."""
    return read_tensor(path / SAE_WEIGHTS, "W_dec", where, confine)


@dataclass(frozen=True, eq=False)
class SAEFeature:
    """One latent of an SAE checkpoint: what clamping it reads (float32). Its value on a
    stream ``x`` is ``act(encoder . x + bias)``, ``act(z) = z * (z > threshold)``
    (ReLU: threshold 0; JumpReLU: its threshold, at least 0), and ``decoder`` is
    its row of ``W_dec``."""

    encoder: np.ndarray  # [d_in]: W_enc[:, f]
    bias: float  # b_enc[f] - b_dec . W_enc[:, f]
    threshold: float
    decoder: np.ndarray  # [d_in]: W_dec[f]


def read_sae_feature(
    path: Path, feature: int, where: str, confine: Confine | None = None
) -> SAEFeature:
    """Latent ``feature`` of the SAE checkpoint in directory ``path``, read as slices
    (an SAE far past ``MAX_TENSOR_BYTES`` costs two rows). TopK is refused: a latent's
    value there depends on every other latent's."""
    from safetensors import safe_open

    cfg, cfg_path = _cfg(path, where, "an SAE", confine)
    arch = cfg.get("architecture")
    if arch not in ("standard", "jumprelu"):
        raise ConfigError(
            f"{where}: architecture {arch!r:.40} cannot be clamped one latent at a time "
            "(standard and jumprelu can; a TopK latent depends on all the others)"
        )
    if cfg.get("normalize_activations", "none") != "none":
        raise ConfigError(f"{where}: normalize_activations must be 'none' (actbus folds it)")
    files = _open(path / SAE_WEIGHTS, where, confine)
    shapes = tensor_shapes(files, where)
    names = ["W_enc", "b_enc", "b_dec", "W_dec"] + (["threshold"] if arch == "jumprelu" else [])
    missing = [n for n in names if n not in shapes]
    if missing:
        raise ConfigError(f"{where}: {files} has no {', '.join(missing)}; not an SAE's weights")
    d_in, d_sae = (shapes["W_enc"] + [0, 0])[:2]
    want = {"W_enc": [d_in, d_sae], "b_enc": [d_sae], "b_dec": [d_in], "W_dec": [d_sae, d_in]}
    want["threshold"] = [d_sae]
    if any(shapes[n] != want[n] for n in names):
        shown = ", ".join(f"{n} {shapes[n]}" for n in names)
        raise ConfigError(f"{where}: the tensors of {files} do not fit together ({shown})")
    if not 0 <= feature < d_sae:
        raise ConfigError(
            f"{where}.feature: {feature} is out of range; the SAE has {d_sae} latents"
        )
    with safe_open(str(files), framework="pt") as f:
        enc = f.get_slice("W_enc")[:, feature : feature + 1].float().numpy().reshape(-1)
        dec = f.get_slice("W_dec")[feature : feature + 1].float().numpy().reshape(-1)
        b_enc = float(f.get_slice("b_enc")[feature : feature + 1].float()[0])
        b_dec = f.get_tensor("b_dec").float().numpy()
        thr = (
            float(f.get_slice("threshold")[feature : feature + 1].float()[0])
            if arch == "jumprelu"
            else 0.0
        )
    if not cfg.get("apply_b_dec_to_input", True):
        b_dec = np.zeros_like(b_dec)
    bias = b_enc - float(np.dot(b_dec.astype(np.float64), enc.astype(np.float64)))
    vals = (enc, dec, np.array([bias, thr]))
    if not all(np.isfinite(v).all() for v in vals) or abs(bias) > 3.4e38:
        raise ConfigError(f"{where}: latent {feature} of {cfg_path.parent} holds NaN or Inf")
    return SAEFeature(enc, bias, max(thr, 0.0), dec)
