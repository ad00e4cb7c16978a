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
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actbus.errors import ConfigError
from actbus.steer.config import VectorSource, check_floats, check_name

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


MAX_TENSOR_BYTES = 256 << 20
"""The largest tensor a path source may name (an SAE's decoder of 65k latents x 1024
is 256 MiB in float32): a bigger one is refused from its header, before it is read."""
MAX_NAMED = 4096
"""Named vectors one engine holds at most (``actbus.steer.max_named`` sets it)."""


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


def _tensor(path: Path, key: str | None, where: str, confine: Confine | None = None) -> np.ndarray:
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


def _unit(v: np.ndarray, where: str) -> np.ndarray:
    n = float(np.linalg.norm(v.astype(np.float64)))
    if not np.isfinite(n) or n == 0.0:
        raise ConfigError(f"{where}: the direction is zero or not finite; nothing to steer with")
    return (v.astype(np.float64) / n).astype(np.float32)


def load_source(src: VectorSource, where: str, confine: Confine | None = None) -> np.ndarray:
    """The values a source names (SAE features and probe directions as unit vectors).
    With ``confine`` (an HTTP caller's source) every file is opened only inside its
    directories, ``~`` is not expanded, and errors do not list a file's tensors."""
    path = Path(src.path) if confine is not None else Path(src.path).expanduser()
    if src.kind == "file":
        return _tensor(path, src.key, where, confine)
    if src.kind == "sae":
        w_dec = _tensor(path / SAE_WEIGHTS, "W_dec", f"{where}.sae", confine)  # [d_sae, d_in]
        if src.feature is None or src.feature >= w_dec.shape[0]:
            raise ConfigError(
                f"{where}.feature: {src.feature} is out of range; the SAE has {w_dec.shape[0]} "
                "latents"
            )
        return _unit(w_dec[src.feature], f"{where}.feature")
    cfg_path = _open(path / PROBE_CFG, f"{where}.probe", confine)
    if not cfg_path.is_file():
        raise ConfigError(f"{where}.probe: {path} has no {PROBE_CFG}; is it a probe checkpoint?")
    if cfg_path.stat().st_size > 1 << 20:
        raise ConfigError(f"{where}.probe: {cfg_path} is over 1 MiB; not a probe's config")
    try:
        heads = json.loads(cfg_path.read_text()).get("heads", {})
        if not isinstance(heads, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in heads.values()
        ):
            raise ValueError("heads")
    except (ValueError, AttributeError, RecursionError):
        raise ConfigError(f"{where}.probe: {cfg_path} is not a probe's config") from None
    head = src.head
    if head is None:
        if len(heads) != 1:
            raise ConfigError(f"{where}.head: the probe has heads {sorted(heads)}; name one")
        head = next(iter(heads))
    if head not in heads:
        raise ConfigError(f"{where}.head: the probe has no head {head!r}; it has {sorted(heads)}")
    weight = _tensor(path / PROBE_WEIGHTS, "linear.weight", f"{where}.probe", confine)
    inv_std = _tensor(path / PROBE_WEIGHTS, "inv_std", f"{where}.probe", confine)
    if heads[head] >= len(weight):
        raise ConfigError(f"{where}.head: the probe's head {head!r} has no row in its weights")
    # The probe reads (x - mean) * inv_std: on raw activations its direction is w * inv_std.
    return _unit(weight[heads[head]] * inv_std, f"{where}.head")


class VectorRegistry:
    """Name -> ``Vector`` for one engine (its residual width). Thread-safe."""

    def __init__(
        self, width: int, live: frozenset[str] = frozenset(), max_named: int = MAX_NAMED
    ) -> None:
        """``live``: the engine's live vector names, which pushes own (not registrable);
        ``max_named``: how many names it holds at most (replacing one is always allowed)."""
        self.width = width
        self.live = live
        self.max_named = max_named
        self._lock = threading.Lock()
        self._named: dict[str, Vector] = {}

    def register(
        self,
        name: str,
        values: np.ndarray | list[float] | VectorSource,
        where: str = "vectors",
        confine: Confine | None = None,
    ) -> Vector:
        """Add or replace ``name``; requests admitted from now on use the new values.
        ``where`` prefixes error messages (the engine's config: ``actbus.steer.vectors``);
        ``confine``: the directories a source's files may be read from (HTTP callers)."""
        check_name(name, where)
        self._room(name, f"{where}.{name}")
        if name in self.live:
            raise ConfigError(
                f"{where}.{name}: a live vector of this engine (actbus.steer.live); its values "
                "change by pushes over the control endpoint (ControlClient.push_vector)"
            )
        where = f"{where}.{name}"
        if isinstance(values, VectorSource):
            values = load_source(values, where, confine)
        elif hasattr(values, "detach"):  # a torch tensor
            values = values.detach().float().cpu().numpy()
        elif isinstance(values, (list, tuple)):  # a client's numbers (HTTP PUT): each named
            if len(values) != self.width:
                raise ConfigError(  # before a long list is converted
                    f"{where}: has {len(values)} values; this model's residual stream has "
                    f"{self.width}"
                )
            values = check_floats(values, where)
        vec = Vector.of(values, where, self.width)
        with self._lock:
            self._room(name, where)  # where names it by now
            self._named[name] = vec
        return vec

    def _room(self, name: str, where: str) -> None:
        """A new name needs room under ``max_named``."""
        if name not in self._named and len(self._named) >= self.max_named:
            raise ConfigError(
                f"{where}: {len(self._named)} named vectors, the most this engine holds "
                f"(actbus.steer.max_named); remove one first (DELETE /v1/actbus/vectors/NAME)"
            )

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
