"""Engine-core side of the steering table: a request waits for its rows, never runs unsteered.

Each rank's ``Steerer`` gives a steered request a row of its device table per distinct
vector, from the step it is first scheduled until the step after it ends, shared by
digest between requests. The front end bounds one request's rows
(``actbus.steer.max_request_vectors``), but requests together can still ask for more
rows than the table has. The scheduler follows the same accounting (``RowBudget``) and
keeps a waiting request out of the step's schedule while its new rows do not fit; it
is scheduled, steered, once enough rows are let go. Later waiting requests that need
rows wait behind it (first come, first served); those that need none go on.

The count is never below the workers': a live vector's row counts once per request
here (the worker shares one version's row between requests), and a request counts
from the step it is scheduled to the step after it ends, as there.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from actbus.steer.live import LIVE_PREFIX

log = logging.getLogger("actbus.steer")


def rows_of(sampling_params: Any) -> tuple[frozenset[str], int]:
    """A request's shared rows (digests) and its live vectors (rows of its own here)."""
    extra = getattr(sampling_params, "extra_args", None) if sampling_params else None
    wire = extra.get("actbus") if isinstance(extra, dict) else None
    steer = wire.get("steer") if isinstance(wire, dict) else None
    if not steer:
        return frozenset(), 0
    live = {str(e[2]) for e in steer["entries"] if str(e[2]).startswith(LIVE_PREFIX)}
    return frozenset(steer["vectors"]), len(live)


class RowBudget:
    """The rows the workers' tables hold, as the scheduler counts them."""

    def __init__(self, usable: int) -> None:
        self.usable = usable
        self._refs: Counter[str] = Counter()
        self._holding: dict[str, tuple[frozenset[str], int]] = {}
        self._live = 0
        self.held_back = 0
        """Times a waiting request was kept out of a step's schedule for rows."""
        self._told: set[str] = set()

    @property
    def in_use(self) -> int:
        return len(self._refs) + self._live

    def hold_back(self, waiting: list[Any]) -> list[Any]:
        """The waiting requests to keep out of this step: those whose new rows do not
        fit if every request before them is scheduled, and those after them that
        need rows."""
        free = self.usable - self.in_use
        planned: set[str] = set()
        held: list[Any] = []
        for r in waiting:
            if r.request_id in self._holding:  # preempted: it holds its rows
                continue
            keys, live = rows_of(getattr(r, "sampling_params", None))
            new = [k for k in keys if k not in self._refs and k not in planned]
            need = len(new) + live
            if not need:
                continue
            if held or need > free:
                held.append(r)
                self.held_back += 1
                if r.request_id not in self._told:
                    self._told.add(r.request_id)
                    log.info(
                        "actbus: request %s waits for %d rows of the steering table "
                        "(%d of %d in use)", r.request_id, need, self.in_use, self.usable,
                    )  # fmt: skip
                continue
            free -= need
            planned.update(new)
        return held

    def scheduled(self, new_reqs: list[Any]) -> None:
        """Rows taken by the requests this step schedules for the first time."""
        for r in new_reqs:
            rid = r.req_id
            if rid in self._holding:
                continue
            keys, live = rows_of(r.sampling_params)
            if keys or live:
                self._holding[rid] = (keys, live)
                self._refs.update(keys)
                self._live += live

    def release(self, rid: str) -> None:
        """A request ended: the workers let its rows go before the next step's new ones."""
        self._told.discard(rid)
        got = self._holding.pop(rid, None)
        if got is None:
            return
        keys, live = got
        self._refs.subtract(keys)
        for k in keys:
            if self._refs[k] <= 0:
                del self._refs[k]
        self._live -= live


def requeue(queue: Any, before: list[Any], held: list[Any]) -> None:
    """Put ``held`` back into ``queue`` in their first places: requests the step put at
    the front (preempted ones) stay first, the others keep the order they had."""
    now = list(queue)
    had = {id(r) for r in before}
    keep = {id(r) for r in now} | {id(r) for r in held}
    order = [r for r in now if id(r) not in had] + [r for r in before if id(r) in keep]
    queue.remove_requests(now)
    for r in order:
        queue.add_request(r)
