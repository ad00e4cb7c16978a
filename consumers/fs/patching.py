"""Activation patching from a stored run: a ``replace`` entry made of the rows the fs
sink stored for one request (``actbus.steer.patch`` builds it; the engine checks it
as any request's rows). The engine never reads a run: the caller does, here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actbus.steer.patch import replace_entry
from consumers.fs.reader import ActivationRun


def from_run(
    run: str | Path | ActivationRun,
    request_id: str,
    layer: int,
    hook: str | None = None,
    positions: list[int] | None = None,
    *,
    at: list[int] | None = None,
    to_layer: int | None = None,
    to_hook: str | None = None,
    sample_index: int | None = None,
) -> dict[str, Any]:
    """Request ``request_id``'s stored rows at ``(layer, hook)`` (``positions``: which;
    None: all) as a ``replace`` entry at the same positions and point unless ``at``,
    ``to_layer`` or ``to_hook`` say otherwise."""
    run = run if isinstance(run, ActivationRun) else ActivationRun(run)
    hook = run.hook_of(layer, hook)
    have, rows = run.request_rows(request_id, layer, hook, sample_index)
    where = {int(p): i for i, p in enumerate(have)}
    want = list(where) if positions is None else [int(p) for p in positions]
    missing = [p for p in want if p not in where]
    if missing:
        raise KeyError(
            f"{run.path}: request {request_id!r} has no rows at positions {missing[:10]}"
        )
    return replace_entry(
        want if at is None else at,
        rows[[where[p] for p in want]],
        layers=layer if to_layer is None else to_layer,
        hooks=hook if to_hook is None else to_hook,
    )
