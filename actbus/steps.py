"""What one engine step tells the features, and how each feature meets the engine.

The engine package (``actbus.engine``) reads vLLM's scheduler output and the model
runner's batch into these views once per step and hands them to the features
(capture, steering, monitors), which never read vLLM objects themselves. The step
loop (``actbus.engine.steploop``) gives each feature the step's ``StepRequests``
(requests that start, with their ``extra_args``, and requests that end, with why)
before or after the forward, and capture and its harvests the ``StepView``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from actbus.errors import VllmVersionError
from actbus.logcap import capped

CHECKED_STEPS = 8
"""Steps with tokens whose whole layout ``StepGuard`` checks (every step when asked)."""


@dataclass
class StepRequests:
    """What the scheduler told the workers about requests for one step."""

    new: list[tuple[str, int, dict[str, Any] | None]]
    """(internal id, prompt length, normalized ``extra_args["actbus"]`` or None)."""
    starts: dict[str, int]
    """Internal id -> position of its first token computed in this step."""
    finished: set[str]
    reasons: dict[str, str]
    scheduled: dict[str, int] | None = None
    """Internal id -> tokens scheduled for it in this step (the guard checks rows)."""
    total: int | None = None
    """Tokens scheduled in this step, all requests together."""


@dataclass
class StepView:
    """One forward step's batch, as the runner laid it out."""

    req_ids: list[str]  # vLLM-internal ids, batch order
    offsets: np.ndarray  # [num_reqs + 1] row offsets per request
    positions: torch.Tensor  # [num_tokens] (any device)
    token_ids: torch.Tensor  # [num_tokens] (any device)
    requests: StepRequests
    started: float | None = None
    """``time.perf_counter()`` when the runner's hook began: the step's capture time
    (``capture_s`` in the bus stats) counts from it."""

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0


class StepHarvest(Protocol):
    """A feature that publishes beside capture, after each forward, on the rows capture
    derived: the same requests, positions and step number, through capture's outlet
    and host copies (monitors' scores, ``actbus.monitor.worker``). The engine hands it
    to the capture worker (``CaptureWorker.harvests``); capture never imports it."""

    def step(
        self,
        step: int,
        req_ids: list[str],
        offsets: np.ndarray,
        host_pos: np.ndarray | None,
        token_ids: torch.Tensor,
        sr: StepRequests,
        publisher: Any,
        to_host: Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], object]],
    ) -> None: ...


class StepGuard:
    """Cheap invariants of each step's layout; the full set on the first real steps.

    Every step: rows laid out equal the tokens the scheduler scheduled. The first
    ``CHECKED_STEPS`` steps with tokens, and every step when ``always`` is set: each
    request's rows equal its scheduled tokens, every request in the batch has a known
    first position, and the device's positions equal the ones actbus derives.
    """

    def __init__(self, *, always: bool = False, version: str = "unknown") -> None:
        self.checked = 0
        self.always = always
        self.version = version  # vLLM's, for the error

    def check(self, view: Any) -> bool:
        """Check the step's layout before its rows are planned; True when its
        positions are to be checked too (``check_positions``). Raises
        ``VllmVersionError`` naming the broken invariant."""
        sr, n = view.requests, view.num_tokens
        if sr.total is not None and n != sr.total:
            self._fail(f"the runner laid out {n} rows, the scheduler scheduled {sr.total} tokens")
        if not n or (self.checked >= CHECKED_STEPS and not self.always):
            return False
        self.checked += 1
        offsets = np.asarray(view.offsets, dtype=np.int64)
        if len(offsets) != len(view.req_ids) + 1 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
            self._fail(
                f"row offsets {capped(offsets.tolist())} do not lay out "
                f"{len(view.req_ids)} requests"
            )
        if sr.scheduled is not None:
            rows = dict(zip(view.req_ids, np.diff(offsets).tolist(), strict=True))
            if rows != {r: int(t) for r, t in sr.scheduled.items()}:
                self._fail(
                    f"rows per request {capped(rows)} differ from tokens scheduled "
                    f"{capped(dict(sr.scheduled))}"
                )
        unknown = [r for r in view.req_ids if r not in sr.starts]
        if unknown:
            self._fail(f"requests {capped(unknown)} ran with no first position from the scheduler")
        return True

    def check_positions(self, view: Any, host_pos: np.ndarray) -> None:
        """The device's positions equal those derived from the scheduler (one sync)."""
        n = view.num_tokens
        dev = view.positions[:n].cpu().numpy()
        if not np.array_equal(dev, host_pos):
            bad = int(np.flatnonzero(dev != host_pos)[0]) if len(dev) == len(host_pos) else 0
            self._fail(
                f"position of row {bad} is {int(dev[bad])} on the device, "
                f"{int(host_pos[bad])} as derived from the scheduler"
            )

    def _fail(self, what: str) -> None:
        raise VllmVersionError(
            f"actbus: on vLLM {self.version}, a step broke an invariant capture relies on: {what}"
        )
