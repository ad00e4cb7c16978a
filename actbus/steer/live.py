"""Live steering vectors: named vectors whose values pushes replace while serving.

The engine's ``actbus.steer.live`` names them (each with its first values, version 1).
A push (``actbus.bus.pushwire.check_vector_push``) arrives at the engine core's control
endpoint, which checks it and hands it to every worker with the next step that runs a
forward, like a monitor push. Each worker keeps the newest values of each live vector
here; a request that steers with one takes the version in use when the worker admits
it (``actbus.steer.worker``) and keeps it to its end. Each version gets its own row of
the device table (its key ``live:NAME:VERSION``), written before the forward of the
step that first uses it: no row a step in flight reads is ever rewritten, nothing is
recompiled, and rows of versions no request uses any more are freed like any other.

The front end does not know which version a request will get: it sends the name
(``live:NAME`` in the entry's vector field) and the worker resolves it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from actbus.steer.config import SteerConfig
from actbus.steer.vectors import Vector, load_source

if TYPE_CHECKING:
    from actbus.bus.pushwire import Push
    from actbus.steer.worker import Steerer

log = logging.getLogger("actbus.steer")

LIVE_PREFIX = "live:"
"""An entry's vector key naming a live vector (real digests are hex)."""


@dataclass(frozen=True, eq=False)
class LiveVersion:
    """One version of a live vector: its values (float32), norm and row key."""

    name: str
    version: int
    vector: Vector

    @property
    def key(self) -> str:
        return f"{LIVE_PREFIX}{self.name}:{self.version}"


class LiveVectors:
    """Name -> the version in use on this worker. Touched only on the step thread."""

    def __init__(self, first: dict[str, np.ndarray], width: int) -> None:
        self.width = width
        self._now = {
            n: LiveVersion(n, 1, Vector.of(v, f"actbus.steer.live.{n}", width))
            for n, v in first.items()
        }

    @classmethod
    def of(cls, cfg: SteerConfig, width: int) -> LiveVectors:
        """The engine's live vectors at their first values (sources load here)."""
        first = {
            n: np.zeros(width, dtype=np.float32)
            if src is None
            else load_source(src, f"actbus.steer.live.{n}")
            for n, src in cfg.live.items()
        }
        return cls(first, width)

    def __bool__(self) -> bool:
        return bool(self._now)

    def names(self) -> list[str]:
        return sorted(self._now)

    def get(self, name: str) -> LiveVersion | None:
        return self._now.get(name)

    def put(self, name: str, version: int, values: np.ndarray) -> bool:
        """Make ``version`` the one new requests get; False (logged) for a name this
        engine does not have or a version not above the current one (the engine core
        checks both before a push reaches a worker)."""
        cur = self._now.get(name)
        if cur is None or version <= cur.version:
            log.error("actbus: live vector push %s version %s ignored", name, version)
            return False
        self._now[name] = LiveVersion(name, version, Vector.of(values, name, self.width))
        return True


def apply_vector_pushes(steer: Steerer, pushes: list[Push], step: int | str) -> None:
    """Hand this step's live vector pushes to this rank's steerer, on every rank (each
    adds the vector to its copy of the stream), before the step's requests are
    admitted: a request first scheduled in the step a push arrives with steers with it."""
    if not pushes:
        return
    for p in pushes:
        if steer.push(p.name, p.version, p.weight):
            log.info(
                "actbus: live vector %s version %d for requests admitted from step %s, "
                "%.1f ms after the push arrived",
                p.name, p.version, step, (time.time() - p.received) * 1e3,
            )  # fmt: skip
