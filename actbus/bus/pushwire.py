"""What a push is on the control channel: its frames and its checks.

A monitor push replaces one monitor's weights with the folded form a checkpoint loads
into (``weight [cols, hidden]``, ``bias [cols]``, ``threshold [cols]`` for JumpReLU:
``actbus.monitor.weights``). The frames are a msgpack header (``op``, ``monitor``,
``shape``, optional ``version`` and call ``id``) and the raw float32 arrays. The
engine core checks every push against the ``Slot`` of each monitor (fixed when the
engine starts: the compiled graph's shape) before anything changes.

A vector push replaces one of the engine's live steering vectors
(``actbus.steer.live``): the header names ``vector`` instead of ``monitor``, its
``shape`` is ``[hidden]`` and one frame holds the float32 values. Versions count per
monitor and per live vector alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from actbus.errors import ConfigError

MAX_VERSION = 2**62
"""No version goes above this (int64 arithmetic everywhere keeps its headroom)."""
MAX_VERSION_STEP = 2**32
"""An explicit version is at most this far above the current one: room for a training
step or a Unix time in seconds, while no one push can use up the version space (and
so lock out later explicit versions): that takes 2**30 accepted pushes."""


@dataclass(frozen=True)
class Slot:
    """What one monitor's table takes: fixed when the engine starts."""

    cols: int
    hidden: int
    activation: str

    @property
    def nbytes(self) -> int:
        return 4 * self.cols * (self.hidden + 2)


@dataclass(frozen=True, eq=False)
class Push:
    """One accepted push, as the workers receive it (pickled with the step)."""

    name: str
    version: int
    weight: np.ndarray  # float32 [cols, hidden]
    bias: np.ndarray  # float32 [cols]
    theta: np.ndarray  # float32 [cols]
    received: float
    """Unix time the engine accepted it."""
    kind: str = "monitor"
    """``monitor``, or ``vector``: a live steering vector (``weight`` holds its values,
    ``bias`` and ``theta`` are empty)."""

    @property
    def key(self) -> tuple[str, str]:
        """What a pending push is kept under: a monitor and a vector may share a name."""
        return (self.kind, self.name)


class PushError(ConfigError):
    """A refused push; ``field`` is the part of it that was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def encode_push(
    monitor: str,
    weight: Any,
    bias: Any,
    threshold: Any = None,
    version: int | None = None,
    *,
    call_id: int | None = None,
) -> list[bytes]:
    """The frames of a push: a msgpack header, then the float32 weight, bias and
    (JumpReLU) threshold bytes."""
    import msgpack

    w = np.ascontiguousarray(np.asarray(weight, dtype=np.float32))
    if w.ndim == 1:
        w = w[None, :]
    b = np.ascontiguousarray(np.asarray(bias, dtype=np.float32).reshape(-1))
    header = _header("monitor", monitor, w.shape, version, call_id)
    frames = [msgpack.packb(header), w.tobytes(), b.tobytes()]
    if threshold is not None:
        frames.append(np.asarray(threshold, dtype=np.float32).reshape(-1).tobytes())
    return frames


def encode_vector_push(
    vector: str, values: Any, version: int | None = None, *, call_id: int | None = None
) -> list[bytes]:
    """The frames of a live steering vector's push: a msgpack header, then the float32
    values (any shape of ``hidden`` numbers is taken flat)."""
    import msgpack

    v = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
    return [msgpack.packb(_header("vector", vector, v.shape, version, call_id)), v.tobytes()]


def _header(
    kind: str, name: str, shape: tuple[int, ...], version: int | None, call_id: int | None
) -> dict[str, Any]:
    """A push's header: what it replaces (``kind``: monitor or vector), the values'
    shape, and the version and call id when given."""
    header: dict[str, Any] = {"op": "push", kind: name, "shape": list(shape)}
    if version is not None:
        header["version"] = version
    if call_id is not None:
        header["id"] = call_id
    return header


def _known_name(
    header: dict[str, Any], field: str, known: dict[str, Any], what: str, hint: str
) -> str:
    """``header[field]`` if it names one of ``known``, else ``PushError`` listing them."""
    name = header.get(field)
    if not isinstance(name, str) or name not in known:
        have = ", ".join(sorted(known)[:20]) or "none"
        raise PushError(
            field, f"no {what} named {str(name)[:60]!r} on this engine (known: {have}); {hint}"
        )
    return name


def _next_version(header: dict[str, Any], current: int, what: str) -> int:
    version = header.get("version")
    if version is None:
        if current >= MAX_VERSION:
            raise PushError(
                "version",
                f"{what} is at the highest version {MAX_VERSION}; restart the engine to "
                "number its pushes afresh",
            )
        return current + 1
    if not isinstance(version, int) or isinstance(version, bool):
        raise PushError("version", f"expected an integer, got {str(version)[:40]}")
    if version > min(current + MAX_VERSION_STEP, MAX_VERSION):
        raise PushError(
            "version",
            f"{str(version)[:40]} is more than {MAX_VERSION_STEP} (2**32) above {what}'s "
            f"current version {current} (or above {MAX_VERSION}): it would use up the "
            "version space; give a smaller version, or leave it out and the engine numbers "
            "the push",
        )
    if version <= current:
        raise PushError(
            "version",
            f"{version} is not above {what}'s current version {current}; versions "
            "only increase (leave it out and the engine numbers the push)",
        )
    return version


def check_vector_push(
    header: dict[str, Any], frames: list[bytes], widths: dict[str, int], versions: dict[str, int]
) -> Push:
    """A live vector's push checked against the engine's live vectors (name -> residual
    width), or ``PushError`` naming the field. ``versions``: the latest accepted."""
    name = _known_name(
        header,
        "vector",
        widths,
        "live steering vector",
        "pushes change the live vectors the engine was started with (actbus.steer.live)",
    )
    width = widths[name]
    if header.get("shape") != [width]:
        raise PushError(
            "values",
            f"shape {str(header.get('shape'))[:40]} does not fit live vector {name!r}: it "
            f"takes [{width}] (the model's residual width)",
        )
    if len(frames) != 1 or len(frames[0]) != 4 * width:
        raise PushError("values", f"expected one frame of {width} float32 for live vector {name!r}")
    values = np.frombuffer(frames[0], dtype=np.float32).copy()
    if not np.isfinite(values).all():
        raise PushError("values", f"holds NaN or Inf values; live vector {name!r} keeps its values")
    version = _next_version(header, versions.get(name, 1), f"live vector {name!r}")
    empty = np.zeros(0, dtype=np.float32)
    return Push(name, version, values, empty, empty, time.time(), kind="vector")


def check_push(
    header: dict[str, Any],
    frames: list[bytes],
    slots: dict[str, Slot],
    versions: dict[str, int],
) -> Push:
    """A push checked against the engine's monitors, or ``PushError`` naming the field.
    ``versions``: each monitor's latest accepted version (pending ones included)."""
    name = _known_name(
        header,
        "monitor",
        slots,
        "monitor",
        "pushes change the weights of monitors the engine was started with",
    )
    slot = slots[name]
    shape = header.get("shape")
    if shape != [slot.cols, slot.hidden]:
        raise PushError(
            "weight",
            f"shape {str(shape)[:40]} does not fit monitor {name!r}: it takes "
            f"[{slot.cols}, {slot.hidden}] (columns x the model's residual width)",
        )
    jump = slot.activation == "jumprelu"
    want = 3 if jump else 2
    if len(frames) != want:
        what = "weight, bias and threshold" if jump else "weight and bias (no threshold)"
        raise PushError(
            "frames", f"monitor {name!r} ({slot.activation}) takes {what}: {len(frames)} given"
        )
    arrays = []
    for field, raw, n in zip(
        ("weight", "bias", "threshold"),
        frames,
        (slot.cols * slot.hidden, slot.cols, slot.cols),
        strict=False,
    ):
        if len(raw) != 4 * n:
            raise PushError(field, f"{len(raw)} bytes; monitor {name!r} takes {n} float32")
        a = np.frombuffer(raw, dtype=np.float32).copy()
        if not np.isfinite(a).all():
            raise PushError(field, f"holds NaN or Inf values; monitor {name!r} keeps its weights")
        arrays.append(a)
    theta = arrays[2] if jump else np.zeros(slot.cols, dtype=np.float32)
    version = _next_version(header, versions.get(name, 1), f"monitor {name!r}")
    return Push(
        name,
        version,
        arrays[0].reshape(slot.cols, slot.hidden),
        arrays[1],
        theta,
        time.time(),
    )
