"""What ``actbus serve`` checks before vLLM starts, from files alone.

From the model's ``config.json`` (a local directory, or the Hugging Face cache; nothing
is downloaded): the architecture, the decoder layers the config taps, steers and
monitors, and the residual width. From the steering vectors' and monitors' checkpoints,
their configs and safetensors headers (no weights are read): their widths against that
one, and the model each was trained on. A mistake found here costs a second and one
line, not an engine start and a traceback; the engine checks it all again
(``actbus.engine.session.validate``), and whatever cannot be found here (a model not
in the local cache) is left to it.

An SAE's ``cfg.json`` is read as the engine reads it (``actbus.checkpoints.read_sae_info``):
an architecture, a normalisation or a ``hook_name`` actbus cannot read is refused here.
A source SAE or probe trained on another model than the one served is not refused (a
model's fine-tune or copy under another name reads the same stream), but warned about,
naming both; so is a monitor's SAE trained on another stream than those it is put at
(its ``hook_name``): ``foreign_sources``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actbus.checkpoints import (
    PROBE_CFG,
    PROBE_WEIGHTS,
    SAE_CFG,
    SAE_WEIGHTS,
    read_sae_info,
    tensor_shapes,
)
from actbus.config import CaptureConfig
from actbus.engine.archs import check_architecture
from actbus.errors import ConfigError

PRECHECKED_ENV = "ACTBUS_PRECHECKED"
"""Set by ``actbus serve`` for its server once this module ran: the engine does not warn
about the sources again."""
_MAX_JSON = 16 << 20
"""The largest config file read (a model's config.json is a few KiB)."""


@dataclass(frozen=True)
class ModelShape:
    """What a model's config.json says of it that capture depends on."""

    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    names: tuple[str, ...]
    """What the model is called: as served, and its config's ``_name_or_path``."""


def model_shape(model: str, served: list[str] | None = None) -> ModelShape | None:
    """The shape of ``model`` (a directory or a hub id in the local cache), or None
    when its config.json is not at hand."""
    path = _config_path(model)
    if path is None:
        return None
    raw = _json(path, "the model's config.json")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    layers = raw.get("num_hidden_layers", text.get("num_hidden_layers"))
    hidden = raw.get("hidden_size", text.get("hidden_size"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, hidden)):
        return None  # an unusual config: vLLM's own reading decides
    archs = raw.get("architectures")
    names = [model, *(served or [])]
    if isinstance(raw.get("_name_or_path"), str) and raw["_name_or_path"]:
        names.append(raw["_name_or_path"])
    return ModelShape(
        tuple(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else (),
        layers,
        hidden,
        tuple(dict.fromkeys(names)),
    )


def precheck(cfg: CaptureConfig, shape: ModelShape) -> list[str]:
    """Refuse (``ConfigError``, naming the field) what ``cfg`` asks of a model of this
    shape that it cannot give; the warnings about its sources."""
    check_architecture(list(shape.architectures))
    model = shape.names[0]
    cfg.resolve_layers(shape.num_layers, model)
    hidden = shape.hidden_size
    if cfg.steer is not None:
        cfg.steer.resolve_layers(shape.num_layers)
        sources = {**cfg.steer.vectors, **{k: v for k, v in cfg.steer.live.items() if v}}
        for name, src in sources.items():
            kind = "vectors" if name in cfg.steer.vectors else "live"
            _check_vector(src, f"actbus.steer.{kind}.{name}", hidden)
    if cfg.monitor is not None:
        cfg.monitor.check_model(shape.num_layers)
        for name, d in cfg.monitor.monitors.items():
            _check_monitor(d, f"actbus.monitor.monitors.{name}", hidden)
    return foreign_sources(cfg, shape.names)


def foreign_sources(cfg: CaptureConfig, names: tuple[str, ...] | list[str]) -> list[str]:
    """A warning for each SAE or probe checkpoint ``cfg`` reads whose config names a
    model other than any of ``names`` (the served model's)."""
    out = []
    for where, kind, path in _checkpoints(cfg):
        trained = trained_on(kind, path)
        if trained and not any(_same_model(trained, n) for n in names):
            out.append(
                f"{where}: the {kind} at {path} was trained on {trained!r} (its "
                f"{SAE_CFG if kind == 'sae' else PROBE_CFG}), but the model served is "
                f"{names[0]!r}; its directions may mean nothing in this model's stream"
            )
    for name, d in cfg.monitor.monitors.items() if cfg.monitor is not None else ():
        if d.kind != "sae" or not d.path:
            continue
        try:
            info = read_sae_info(Path(d.path).expanduser(), "")
        except ConfigError:
            continue  # loading it says why
        if info.point is not None and info.point not in d.points:
            layer, hook = info.point
            out.append(
                f"actbus.monitor.monitors.{name}: the sae at {d.path} was trained on layer "
                f"{layer}'s {hook} (hook_name {info.hook_name!r}, its {SAE_CFG}), but the "
                f"monitor reads {', '.join(f'layer {la} {h}' for la, h in d.points)}"
            )
    return out


def trained_on(kind: str, path: str | Path) -> str | None:
    """The model an SAE (SAELens' ``model_name``) or probe checkpoint was trained on,
    if its config says."""
    d = Path(path).expanduser()
    try:
        if kind == "sae":  # SAELens 6.x keeps it in metadata; older configs at the top
            raw = _json(d / SAE_CFG, f"the SAE's {SAE_CFG}")
            meta = raw.get("metadata") or {}
            name = (
                meta.get("model_name")
                or raw.get("model_name")
                or ((raw.get("actbus") or {}).get("source") or {}).get("model")
            )
        else:
            raw = _json(d / PROBE_CFG, f"the probe's {PROBE_CFG}")
            name = (raw.get("source") or {}).get("model")
    except (ConfigError, AttributeError):
        return None  # unreadable: loading it says why
    return name if isinstance(name, str) and name else None


def _same_model(a: str, b: str) -> bool:
    """One model under two spellings: equal, or the same last path part (a hub id's
    name and the directory it was downloaded to)."""
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or a.rsplit("/", 1)[-1].lower() == b.rsplit("/", 1)[-1].lower()


def _checkpoints(cfg: CaptureConfig) -> list[tuple[str, str, str]]:
    """(where, kind, path) of every SAE and probe checkpoint the config reads."""
    out = []
    if cfg.steer is not None:
        for kind, group in (("vectors", cfg.steer.vectors), ("live", cfg.steer.live)):
            for name, src in group.items():
                if src is not None and src.kind in ("sae", "probe"):
                    out.append((f"actbus.steer.{kind}.{name}", src.kind, src.path))
    if cfg.monitor is not None:
        for name, d in cfg.monitor.monitors.items():
            if d.kind in ("sae", "probe") and d.path:
                out.append((f"actbus.monitor.monitors.{name}", d.kind, d.path))
    return out


def _check_vector(src: Any, where: str, hidden: int) -> None:
    path = Path(src.path).expanduser()
    if src.kind == "file":
        shapes = tensor_shapes(path, where)
        key = src.key
        if key is None and len(shapes) == 1:
            key = next(iter(shapes))
        if key not in shapes:
            return  # which tensor: loading it says
        width = math.prod(shapes[key])
    elif src.kind == "sae":
        if (path / SAE_CFG).is_file():
            _check_sae_info(path, f"{where}.sae", hidden)
        shape = tensor_shapes(path / SAE_WEIGHTS, f"{where}.sae").get("W_dec")  # [d_sae, d_in]
        if shape is None or len(shape) != 2:
            return
        if src.feature is not None and src.feature >= shape[0]:
            raise ConfigError(
                f"{where}.feature: {src.feature} is out of range; the SAE has {shape[0]} latents"
            )
        width = shape[1]
    else:
        shape = tensor_shapes(path / PROBE_WEIGHTS, f"{where}.probe").get("linear.weight")
        if shape is None or len(shape) != 2:
            return
        width = shape[1]
    if width != hidden:
        raise ConfigError(f"{where}: has {width} values; this model's residual stream has {hidden}")


def _check_monitor(d: Any, where: str, hidden: int) -> None:
    if d.kind == "weight":
        width = len(d.weight)
    elif d.kind == "probe":
        shape = tensor_shapes(Path(d.path).expanduser() / PROBE_WEIGHTS, f"{where}.probe").get(
            "linear.weight"
        )
        if shape is None or len(shape) != 2:
            return
        width = shape[1]
    else:
        _check_sae_info(Path(d.path).expanduser(), f"{where}.sae", hidden)
        shape = tensor_shapes(Path(d.path).expanduser() / SAE_WEIGHTS, f"{where}.sae").get("W_enc")
        if shape is None or len(shape) != 2:  # [d_in, d_sae]
            return
        width = shape[0]
    if width != hidden:
        raise ConfigError(
            f"{where}: the weights are {width} wide; this model's residual stream has {hidden}"
        )


def _check_sae_info(path: Path, where: str, hidden: int) -> None:
    """An SAE's config: one actbus reads, made for a model of this width."""
    info = read_sae_info(path, where)
    if info.d_in is not None and info.d_in != hidden:
        raise ConfigError(
            f"{where}: the SAE reads {info.d_in}-wide rows (d_in, its {SAE_CFG}); this model's "
            f"residual stream has {hidden}: it was made for another model"
            + (f" ({info.model_name!r})" if info.model_name else "")
        )


def _config_path(model: str) -> Path | None:
    local = Path(model).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    if local.exists() or model.count("/") > 1:
        return None
    try:  # a hub id: only what is already in the local cache
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json")
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def _json(path: Path, what: str) -> dict[str, Any]:
    try:
        if path.stat().st_size > _MAX_JSON:
            raise ConfigError(f"{path}: {what} is over {_MAX_JSON >> 20} MiB")
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read {what} ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {what} is not a JSON object")
    return raw
