"""Named steering vectors: loaded from files and checkpoints, held by the front end.

Requests name vectors; the front end resolves each name to its values when the
request is admitted and sends them with it, so the worker's device table only ever
holds vectors of requests in flight. Registering, replacing or removing a name is a
change of this registry alone: nothing reaches the compiled model, and a request
already running keeps the vector it started with.

SAE and probe checkpoints are read in the file formats ``actbus run sae`` and
``actbus run probe`` write (``trainers/checkpoint.py``), without importing trainers.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actbus.errors import ConfigError
from actbus.steer.config import VectorSource, check_name

SAE_WEIGHTS = "sae_weights.safetensors"
PROBE_WEIGHTS = "probe.safetensors"
PROBE_CFG = "probe.json"


@dataclass(frozen=True, eq=False)
class Vector:
    """Float32 values with their digest (what identifies them on the device) and norm."""

    values: np.ndarray
    digest: str
    norm: float

    @classmethod
    def of(cls, values: np.ndarray | list[float] | tuple[float, ...], where: str, width: int):
        v = np.asarray(values, dtype=np.float32).reshape(-1).copy()
        if v.shape[0] != width:
            raise ConfigError(
                f"{where}: has {v.shape[0]} values; this model's residual stream has {width}"
            )
        if not np.isfinite(v).all():
            raise ConfigError(f"{where}: holds NaN or Inf values")
        v.setflags(write=False)
        digest = hashlib.sha256(v.tobytes()).hexdigest()[:32]
        return cls(v, digest, float(np.linalg.norm(v.astype(np.float64))))


def _tensor(path: Path, key: str | None, where: str) -> np.ndarray:
    from safetensors import safe_open

    if not path.is_file():
        raise ConfigError(f"{where}: {path} is not a file")
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if key is None:
            if len(keys) != 1:
                raise ConfigError(f"{where}.key: {path} holds {keys}; name the tensor to use")
            key = keys[0]
        if key not in keys:
            raise ConfigError(f"{where}.key: {path} has no tensor {key!r}; it holds {keys}")
        return f.get_tensor(key).float().numpy()


def _unit(v: np.ndarray, where: str) -> np.ndarray:
    n = float(np.linalg.norm(v.astype(np.float64)))
    if not np.isfinite(n) or n == 0.0:
        raise ConfigError(f"{where}: the direction is zero or not finite; nothing to steer with")
    return (v.astype(np.float64) / n).astype(np.float32)


def load_source(src: VectorSource, where: str) -> np.ndarray:
    """The values a source names (SAE features and probe directions as unit vectors)."""
    path = Path(src.path).expanduser()
    if src.kind == "file":
        return _tensor(path, src.key, where)
    if src.kind == "sae":
        w_dec = _tensor(path / SAE_WEIGHTS, "W_dec", f"{where}.sae")  # [d_sae, d_in]
        if src.feature is None or src.feature >= w_dec.shape[0]:
            raise ConfigError(
                f"{where}.feature: {src.feature} is out of range; the SAE has {w_dec.shape[0]} "
                "latents"
            )
        return _unit(w_dec[src.feature], f"{where}.feature")
    cfg_path = path / PROBE_CFG
    if not cfg_path.is_file():
        raise ConfigError(f"{where}.probe: {path} has no {PROBE_CFG}; is it a probe checkpoint?")
    heads: dict[str, int] = json.loads(cfg_path.read_text()).get("heads", {})
    head = src.head
    if head is None:
        if len(heads) != 1:
            raise ConfigError(f"{where}.head: the probe has heads {sorted(heads)}; name one")
        head = next(iter(heads))
    if head not in heads:
        raise ConfigError(f"{where}.head: the probe has no head {head!r}; it has {sorted(heads)}")
    weight = _tensor(path / PROBE_WEIGHTS, "linear.weight", f"{where}.probe")
    inv_std = _tensor(path / PROBE_WEIGHTS, "inv_std", f"{where}.probe")
    # The probe reads (x - mean) * inv_std: on raw activations its direction is w * inv_std.
    return _unit(weight[heads[head]] * inv_std, f"{where}.head")


class VectorRegistry:
    """Name -> ``Vector`` for one engine (its residual width). Thread-safe."""

    def __init__(self, width: int, live: frozenset[str] = frozenset()) -> None:
        """``live``: the engine's live vector names, which pushes own (not registrable)."""
        self.width = width
        self.live = live
        self._lock = threading.Lock()
        self._named: dict[str, Vector] = {}

    def register(
        self, name: str, values: np.ndarray | list[float] | VectorSource, where: str = "vectors"
    ) -> Vector:
        """Add or replace ``name``; requests admitted from now on use the new values.
        ``where`` prefixes error messages (the engine's config: ``actbus.steer.vectors``)."""
        check_name(name, where)
        if name in self.live:
            raise ConfigError(
                f"{where}.{name}: a live vector of this engine (actbus.steer.live); its values "
                "change by pushes over the control endpoint (ControlClient.push_vector)"
            )
        where = f"{where}.{name}"
        if isinstance(values, VectorSource):
            values = load_source(values, where)
        elif hasattr(values, "detach"):  # a torch tensor
            values = values.detach().float().cpu().numpy()
        vec = Vector.of(values, where, self.width)
        with self._lock:
            self._named[name] = vec
        return vec

    def remove(self, name: str) -> None:
        with self._lock:
            if self._named.pop(name, None) is None:
                raise KeyError(f"no steering vector named {name!r}")

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._named)

    def get(self, name: str, where: str) -> Vector:
        with self._lock:
            vec = self._named.get(name)
            known = sorted(self._named) if vec is None else []
        if vec is None:
            known = sorted([*known, *self.live])
            listed = ", ".join(known[:20]) or "none registered"
            raise ConfigError(f"{where}: no steering vector named {name!r} (known: {listed})")
        return vec
