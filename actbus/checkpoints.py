"""The probe and SAE checkpoint formats: their file names, and the one reader of them.

``trainers/checkpoint.py`` writes them (``actbus run sae``, ``actbus run probe``) with
the names below; steering sources (``actbus.steer.vectors``), monitors
(``actbus.monitor.weights``), ``actbus serve``'s precheck and the trainers' own
loaders (``read_config``, ``read_tensors``) read them here, without importing
trainers. A checkpoint is a file like any peer's: every tensor is refused from its
header when it is too big, a config when it is over ``MAX_CFG_BYTES`` or not of the
form written, and each refusal names the field.

- An SAE directory holds ``cfg.json`` and ``sae_weights.safetensors`` in SAELens'
  (6.x) inference format, as ``SAE.save_model`` writes it and as actbus's trainers
  write it (the input scale folded into the weights): latents read
  ``(x - b_dec) @ W_enc + b_enc`` of the raw stream (``b_dec`` only with
  ``apply_b_dec_to_input``), then ReLU (``standard``), JumpReLU (``threshold``) or TopK
  (``k``, on pre-activations times ``||W_dec[f]||`` with
  ``rescale_acts_by_decoder_norm``); the decoder rows ``W_dec[f]`` are the latents'
  directions. Tensors of any float dtype are read as float32. ``metadata.hook_name``
  (top-level in configs older than 6.0) names the stream it was trained on, a
  TransformerLens or Hugging Face name that ``hook_point`` maps to actbus's; a name
  actbus does not tap, an input normalisation not folded into the weights, or any
  other architecture (gated, transcoders, ...) is refused by name.
  ``actbus_state.safetensors`` keeps what SAELens has no name for (training state).
- A probe directory holds ``probe.safetensors`` (``linear.weight``, ``linear.bias``,
  ``mean``, ``inv_std``) and ``probe.json`` (``heads``: which row predicts which tag;
  ``actbus.kind``: logistic or linear). Head ``h`` reads
  ``linear((x - mean) * inv_std)[h]``.
"""

from __future__ import annotations

import json
import os
import re
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
TL_HOOKS = {
    "pre_attn": "hook_resid_pre",
    "post_attn": "hook_resid_mid",
    "mlp_out": "hook_mlp_out",
    "post_block": "hook_resid_post",
}
"""actbus hook -> the TransformerLens hook point of decoder layer L (``blocks.L.NAME``)."""
_TL_NAME = re.compile(r"blocks\.(\d{1,6})\.(hook_[a-z_]+)")
_HF_NAME = re.compile(
    r"(?:model\.|model\.language_model\.|language_model\.model\.)?layers\.(\d{1,6})"
)
"""A decoder layer's module in Hugging Face transformers: its output is ``post_block``."""

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


def _safetensors(path: Path, where: str, confine: Confine | None):
    """The opened safetensors file at ``path`` (a context manager), or a ConfigError."""
    from safetensors import safe_open

    path = _open(path, where, confine)
    if not path.is_file():
        raise ConfigError(f"{where}: {path} is not a file")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # not a safetensors file: say so, not how it failed inside
        raise ConfigError(
            f"{where}: {path} is not a safetensors file ({type(e).__name__})"
        ) from None


def _bounded(f: Any, key: str, where: str) -> Any:
    """Tensor ``key`` of an open file, refused from its header when over
    ``MAX_TENSOR_BYTES`` as float32."""
    size = int(np.prod(f.get_slice(key).get_shape(), dtype=np.int64)) * 4  # read as float32
    if size > MAX_TENSOR_BYTES:
        raise ConfigError(
            f"{where}.key: tensor {key!r:.100} is {size} bytes as float32, more than the "
            f"{MAX_TENSOR_BYTES} a checkpoint's tensor may be"
        )
    return f.get_tensor(key)


def read_tensor(
    path: Path, key: str | None, where: str, confine: Confine | None = None
) -> np.ndarray:
    """Tensor ``key`` of a safetensors file as float32 (``None``: the file's only one),
    refused from the header when over ``MAX_TENSOR_BYTES``. With ``confine`` the file
    is opened only inside its directories, and errors do not list the file's tensors."""
    with _safetensors(path, where, confine) as f:
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
        return _bounded(f, key, where).float().numpy()


MAX_TENSORS = 64
"""Tensors one checkpoint file may hold (those actbus writes hold at most 5)."""


def read_tensors(path: Path, where: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint file (the trainers' modules rebuilt from their own
    files): floating ones as float32, others (counters, flags) in their own dtype; each
    bounded as ``read_tensor``'s, at most ``MAX_TENSORS``."""
    with _safetensors(path, where, None) as f:
        keys = list(f.keys())
        if len(keys) > MAX_TENSORS:
            raise ConfigError(f"{where}: {path} holds {len(keys)} tensors, over {MAX_TENSORS}")
        out = {}
        for k in keys:
            t = _bounded(f, k, where)
            out[k] = (t.float() if t.is_floating_point() else t).numpy()
        return out


def read_config(path: Path, where: str, kind: str) -> dict[str, Any]:
    """The JSON config of the ``kind`` ("sae" or "probe") checkpoint in directory
    ``path``, bounded and a mapping (its fields are the caller's to read)."""
    return _cfg(path, where, "an SAE" if kind == "sae" else "a probe", None)[0]


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


def tl_hook_name(layer: int, hook: str) -> str:
    """The TransformerLens name of an actbus (layer, hook) stream (what actbus writes as
    an SAE's ``hook_name``)."""
    if hook not in TL_HOOKS:
        raise ValueError(f"hook: {hook!r} has no TransformerLens name; expected {list(TL_HOOKS)}")
    return f"blocks.{layer}.{TL_HOOKS[hook]}"


def hook_point(name: str, where: str) -> tuple[int, str]:
    """The actbus stream ``(layer, hook)`` an SAELens ``hook_name`` reads:
    ``blocks.L.hook_resid_pre`` / ``hook_resid_mid`` / ``hook_mlp_out`` /
    ``hook_resid_post`` (TransformerLens), or ``model.layers.L`` (a Hugging Face decoder
    layer's output, ``post_block``). Any other name is a stream actbus does not tap."""
    tl = _TL_NAME.fullmatch(name)
    if tl is not None:
        hook = next((h for h, n in TL_HOOKS.items() if n == tl[2]), None)
        if hook is not None:
            return int(tl[1]), hook
    hf = _HF_NAME.fullmatch(name)
    if hf is not None:
        return int(hf[1]), "post_block"
    known = ", ".join(f"blocks.L.{n} ({h})" for h, n in TL_HOOKS.items())
    raise ConfigError(
        f"{where}: hook_name {name!r:.80} is not a stream actbus taps; it taps {known} and "
        "model.layers.L (post_block): an SAE trained elsewhere (attention outputs, hook_z, "
        "MLP internals) cannot read this engine's rows"
    )


@dataclass(frozen=True)
class SAEInfo:
    """What an SAE's ``cfg.json`` says, checked (no tensors read)."""

    architecture: str  # one of SAE_ARCHITECTURES
    d_in: int | None
    d_sae: int | None
    k: int
    """TopK: latents kept per token (0 otherwise)."""
    apply_b_dec_to_input: bool
    rescale_acts_by_decoder_norm: bool
    """TopK: SAELens ranks and returns pre-activations times ``||W_dec[f]||``."""
    hook_name: str | None
    point: tuple[int, str] | None
    """The actbus stream ``hook_name`` names (None: the config does not say)."""
    model_name: str | None


_NORMALISE_FIX = {
    "expected_average_only_in": "fold the scale into the weights first (SAELens: "
    "sae.fold_activation_norm_scaling_factor(s), then sae.save_model(dir))",
    "covariance_whitening": "fold the whitening into the weights first (SAELens: "
    "sae.fold_activation_whitening(...), then sae.save_model(dir))",
}


def read_sae_info(path: Path, where: str, confine: Confine | None = None) -> SAEInfo:
    """The config of the SAE checkpoint in directory ``path``: SAELens' 6.x layout
    (``metadata.hook_name``), or an older one (``hook_name`` or ``hook_point`` at the
    top, TopK as ``activation_fn: topk`` with ``activation_fn_kwargs.k``). Refuses by
    field what actbus cannot read the way SAELens' ``encode`` does."""
    cfg, cfg_path = _cfg(path, where, "an SAE", confine)
    meta = cfg.get("metadata")
    meta = meta if isinstance(meta, dict) else {}

    def said(name: str, *old: str) -> Any:
        for k in (name, *old):
            if meta.get(k) is not None:
                return meta[k]
            if cfg.get(k) is not None:
                return cfg[k]
        return None

    arch = cfg.get("architecture", "standard")
    act = said("activation_fn", "activation_fn_str")  # configs before SAELens 6.0
    if act not in (None, "relu") and arch == "standard":
        kw = cfg.get("activation_fn_kwargs")
        if act != "topk" or not isinstance(kw, dict) or "k" not in kw:
            raise ConfigError(
                f"{where}: activation_fn {act!r:.40} in {cfg_path} is not one actbus reads "
                "(relu, or topk with activation_fn_kwargs.k)"
            )
        arch, k_raw = "topk", kw["k"]
    else:
        k_raw = cfg.get("k")
    if arch not in SAE_ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {arch!r:.40} (its {SAE_CFG}) is not one actbus reads "
            f"(valid: {', '.join(SAE_ARCHITECTURES)}; a BatchTopK SAE saved for inference is "
            "a jumprelu)"
        )
    norm = cfg.get("normalize_activations", "none")
    if norm not in ("none", None, False):
        norm = "expected_average_only_in" if norm is True else norm
        fix = _NORMALISE_FIX.get(
            norm, "it normalises each token by itself, which no linear monitor can fold"
        )
        raise ConfigError(
            f"{where}: normalize_activations is {norm!r:.40} (its {SAE_CFG}); actbus reads "
            f"SAEs that take the raw stream ('none'): {fix}"
        )
    if cfg.get("reshape_activations", "none") not in ("none", None):
        raise ConfigError(
            f"{where}: reshape_activations {cfg['reshape_activations']!r:.40} (its {SAE_CFG}) "
            "reads attention heads (hook_z), not the residual stream; actbus reads 'none'"
        )
    if said("hook_head_index", "hook_point_head_index") is not None:
        raise ConfigError(
            f"{where}: hook_head_index in {cfg_path} names one attention head; actbus reads "
            "the whole residual stream"
        )
    d_in, d_sae = (_opt_int(cfg.get(n), f"{where}: {n} in {cfg_path}") for n in ("d_in", "d_sae"))
    k = 0
    if arch == "topk":
        k = _opt_int(k_raw, f"{where}: k in {cfg_path}") or 0
        if k < 1 or (d_sae is not None and k > d_sae):
            raise ConfigError(
                f"{where}: k in {cfg_path} is {k}; a TopK SAE keeps 1..d_sae"
                + (f" ({d_sae})" if d_sae else "")
                + " latents"
            )
    flags = {}
    for n, default in (("apply_b_dec_to_input", True), ("rescale_acts_by_decoder_norm", False)):
        v = cfg.get(n, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: {n} in {cfg_path} is not true or false")
        flags[n] = v
    hook_name = said("hook_name", "hook_point")
    if hook_name is not None and not isinstance(hook_name, str):
        raise ConfigError(f"{where}: hook_name in {cfg_path} is not a string")
    point = hook_point(hook_name, where) if hook_name else None
    model = said("model_name")
    return SAEInfo(
        arch,
        d_in,
        d_sae,
        k,
        flags["apply_b_dec_to_input"],
        flags["rescale_acts_by_decoder_norm"] and arch == "topk",
        hook_name or None,
        point,
        model if isinstance(model, str) and model else None,
    )


def _opt_int(v: Any, what: str) -> int | None:
    """A config's optional positive integer (None when absent)."""
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_TENSOR_BYTES:
        raise ConfigError(f"{what} is {v!r:.40}, not a positive integer")
    return v


@dataclass(frozen=True, eq=False)
class SAEEncoder:
    """What an SAE checkpoint scores latents with (float32, SAELens' names): latent ``f``
    of ``x`` is ``act(((x - b_dec) @ W_enc + b_enc)[f] * latent_scale[f])``, exactly
    SAELens' ``encode``."""

    architecture: str  # one of SAE_ARCHITECTURES
    k: int
    """TopK: latents kept per token (0 otherwise)."""
    W_enc: np.ndarray  # [d_in, d_sae]
    b_enc: np.ndarray  # [d_sae]
    b_dec: np.ndarray  # [d_in]: zeros unless apply_b_dec_to_input
    threshold: np.ndarray | None  # [d_sae]: JumpReLU only
    """A latent fires where its pre-activation is above it; never below 0 (SAELens'
    JumpReLU is ``relu(pre) * (pre > threshold)``, which is ``pre * (pre > max(threshold,
    0))``)."""
    latent_scale: np.ndarray | None = None  # [d_sae]
    """TopK with ``rescale_acts_by_decoder_norm``: ``||W_dec[f]||``, which multiplies each
    pre-activation (and so the latent); its decoder direction is then ``W_dec[f]``
    divided by that norm. None: 1."""
    info: SAEInfo | None = None
    """Its config (``hook_name``, ``point``, ``model_name``)."""

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])


def read_sae_encoder(path: Path, where: str) -> SAEEncoder:
    """The encoder of the SAE checkpoint in directory ``path``, as a monitor reads it:
    ``cfg.json`` first (``read_sae_info``), then the tensors, checked against it and
    each other, finite."""
    info = read_sae_info(path, where)
    files = path / SAE_WEIGHTS
    t = {k: read_tensor(files, k, where) for k in ("W_enc", "b_enc", "b_dec")}
    if info.architecture == "jumprelu":
        t["threshold"] = read_tensor(files, "threshold", where)
    if info.rescale_acts_by_decoder_norm:
        t["W_dec"] = read_tensor(files, "W_dec", where)
    w_enc, b_enc, b_dec = t["W_enc"], t["b_enc"], t["b_dec"]
    if w_enc.ndim != 2 or b_enc.shape != w_enc.shape[1:] or b_dec.shape != w_enc.shape[:1]:
        _misfit(t, files, where)
    if "threshold" in t and t["threshold"].shape != b_enc.shape:
        _misfit(t, files, where)
    if "W_dec" in t and t["W_dec"].shape != w_enc.shape[::-1]:
        _misfit(t, files, where)
    _fits_cfg(info, w_enc.shape, files, where)
    for k, v in t.items():
        if not np.isfinite(v).all():
            raise ConfigError(f"{where}: {k} in {files} holds NaN or Inf values")
    if not info.apply_b_dec_to_input:
        b_dec = np.zeros_like(b_dec)
    threshold = np.maximum(t["threshold"], 0.0) if "threshold" in t else None
    scale = None
    if "W_dec" in t:
        scale = np.linalg.norm(t["W_dec"].astype(np.float64), axis=1).astype(np.float32)
        if not np.isfinite(scale).all():
            raise ConfigError(f"{where}: W_dec in {files} has rows whose norm is not finite")
    return SAEEncoder(info.architecture, info.k, w_enc, b_enc, b_dec, threshold, scale, info)


def _fits_cfg(info: SAEInfo, w_enc: tuple[int, ...], files: Path, where: str) -> None:
    """``W_enc`` [d_in, d_sae] is the shape its config says."""
    for name, said, has in (("d_in", info.d_in, w_enc[0]), ("d_sae", info.d_sae, w_enc[1])):
        if said is not None and said != has:
            raise ConfigError(
                f"{where}: {SAE_CFG} says {name}={said}, but {files} holds {has}; the "
                "config and the weights are of two different SAEs"
            )
    if info.k > w_enc[1]:
        raise ConfigError(f"{where}: k={info.k} in {SAE_CFG}, but the SAE has {w_enc[1]} latents")


def read_sae_decoder(path: Path, where: str, confine: Confine | None = None) -> np.ndarray:
    """The decoder ``W_dec`` [d_sae, d_in] of the SAE checkpoint in directory ``path``:
    its rows are the latents' directions. Its ``cfg.json``, where there is one, is
    checked as ``read_sae_info`` does (a stream actbus does not tap is refused)."""
    cfg_path = _open(path / SAE_CFG, where, confine)
    info = read_sae_info(path, where, confine) if cfg_path.is_file() else None
    files = path / SAE_WEIGHTS
    w_dec = read_tensor(files, "W_dec", where, confine)
    if w_dec.ndim != 2:
        _misfit({"W_dec": w_dec}, files, where)
    if info is not None:
        _fits_cfg(info, w_dec.shape[::-1], files, where)
    return w_dec


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

    info = read_sae_info(path, where, confine)  # SAELens' layouts and refusals
    arch = info.architecture
    if arch not in ("standard", "jumprelu"):
        raise ConfigError(
            f"{where}: architecture {arch!r:.40} cannot be clamped one latent at a time "
            "(standard and jumprelu can; a TopK latent depends on all the others)"
        )
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
    if not info.apply_b_dec_to_input:
        b_dec = np.zeros_like(b_dec)
    bias = b_enc - float(np.dot(b_dec.astype(np.float64), enc.astype(np.float64)))
    vals = (enc, dec, np.array([bias, thr]))
    if not all(np.isfinite(v).all() for v in vals) or abs(bias) > 3.4e38:
        raise ConfigError(f"{where}: latent {feature} of {path} holds NaN or Inf")
    return SAEFeature(enc, bias, max(thr, 0.0), dec)
