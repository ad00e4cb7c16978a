"""Activation patching: ``replace`` entries made from rows another run captured.

A ``replace`` entry carries its rows inline (``rows[j]`` replaces the stream at
``positions[j]``). These helpers build one from rows already at hand: a returned
capture (``out.outputs[0].activations``, or anything with ``positions`` and
``[(layer, hook)]``), or, in ``consumers.fs.patching``, a stored run. The rows are
checked as any request's when the entry is sent (finite float32, the model's
width, int32 positions); nothing here trusts them.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def replace_entry(
    positions: Any,
    rows: Any,
    *,
    layers: int | list[int],
    hooks: str | list[str] = "post_block",
    tier: str = "base",
) -> dict[str, Any]:
    """A ``replace`` entry: ``rows[j]`` (``[n, hidden]``) becomes the stream at
    ``positions[j]`` at each of ``layers`` x ``hooks``."""
    pos = [int(p) for p in np.asarray(positions).reshape(-1)]
    arr = rows.detach().float().cpu().numpy() if hasattr(rows, "detach") else np.asarray(rows)
    if arr.ndim != 2 or arr.shape[0] != len(pos):
        raise ValueError(f"rows: expected [{len(pos)}, hidden] (one per position), got {arr.shape}")
    return {
        "op": "replace",
        "layers": layers,
        "hooks": hooks,
        "tier": tier,
        "positions": pos,
        "rows": arr.astype(np.float32).tolist(),
    }


def from_capture(
    acts: Any,
    layer: int,
    hook: str = "post_block",
    positions: list[int] | None = None,
    *,
    at: list[int] | None = None,
    to_layer: int | None = None,
    to_hook: str | None = None,
) -> dict[str, Any]:
    """A ``replace`` entry patching a returned capture's rows at ``(layer, hook)`` into
    another request: the rows of ``positions`` (None: every captured one), at the
    same positions unless ``at`` lists others, and the same point unless ``to_layer``
    / ``to_hook`` say otherwise."""
    have = [int(p) for p in np.asarray(acts.positions).reshape(-1)]
    want = have if positions is None else [int(p) for p in positions]
    where = {p: i for i, p in enumerate(have)}
    missing = [p for p in want if p not in where]
    if missing:
        raise KeyError(f"positions {missing[:10]} were not captured (captured: {have[:20]}...)")
    rows = acts[(layer, hook)][[where[p] for p in want]]
    target = want if at is None else list(at)
    return replace_entry(
        target,
        rows,
        layers=layer if to_layer is None else to_layer,
        hooks=hook if to_hook is None else to_hook,
    )
