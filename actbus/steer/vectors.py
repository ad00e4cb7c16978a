"""Named steering vectors: loaded from files and checkpoints, held by the front end.

Requests name vectors; the front end resolves each name to its values when the
request is admitted and sends them with it, so the worker's device table only ever
holds vectors of requests in flight. Registering, replacing or removing a name is a
change of this registry alone: nothing reaches the compiled model, and a request
already running keeps the vector it started with.

SAE and probe checkpoints are read through ``actbus.checkpoints``, the one reader of
the formats ``actbus run sae`` and ``actbus run probe`` write.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actbus.checkpoints import Confine, read_probe, read_sae_decoder, read_tensor
from actbus.errors import ConfigError
from actbus.fields import check_name
from actbus.steer.config import VectorSource, check_floats


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


MAX_NAMED = 4096
"""Named vectors one engine holds at most (``actbus.steer.max_named`` sets it)."""


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
        return read_tensor(path, src.key, where, confine)
    if src.kind == "sae":
        w_dec = read_sae_decoder(path, f"{where}.sae", confine)  # [d_sae, d_in]
        if src.feature is None or src.feature >= w_dec.shape[0]:
            raise ConfigError(
                f"{where}.feature: {src.feature} is out of range; the SAE has {w_dec.shape[0]} "
                "latents"
            )
        return _unit(w_dec[src.feature], f"{where}.feature")
    probe = read_probe(path, f"{where}.probe", confine)
    row = probe.row(src.head, f"{where}.head")
    # The probe reads (x - mean) * inv_std: on raw activations its direction is w * inv_std.
    return _unit(probe.weight[row] * probe.inv_std, f"{where}.head")


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
