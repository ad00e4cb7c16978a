"""Expert load per layer, from the ``router`` stream of a mixture-of-experts model.

A router row is ``[ids (top_k), weights (top_k)]`` in float32 (``actbus.wire``): per
token the experts its layer chose and their routing weights. ``ExpertLoad`` counts,
per layer and expert, the tokens routed to it (each of a token's top-k choices counts
once) and the routing weight they carried, in fixed memory: one ``[num_experts]``
count and weight sum per layer, the number of experts and ``top_k`` taken from the
publisher's WELCOME (``router: {num_experts, top_k}``). Both come from a peer, so
both are checked against bounds here, and so is every row: a row whose width is not
``2 * top_k``, or whose ids are not integers in ``[0, num_experts)``, or whose numbers
are not finite, is counted (``bad_rows``) and kept out of every figure. ``actbus
stats`` and the dashboards (web and W&B) show the same snapshot.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actbus.logcap import capped

MAX_EXPERTS = 1 << 12
"""Experts per layer this counts (DeepSeek-V3: 256, Qwen3-Next: 512)."""
MAX_LAYERS = 512
"""Layers counted; rows of layers past this many are counted in ``layers_overflow_rows``."""


def router_info(welcome: Any) -> tuple[int, int] | None:
    """``(num_experts, top_k)`` of a WELCOME's ``router`` entry; None where it has none
    (a dense model, or a router not tapped). A malformed entry raises ``ValueError``
    naming the field: it is a peer's."""
    if not isinstance(welcome, dict) or welcome.get("router") is None:
        return None
    r = welcome["router"]
    if not isinstance(r, dict):
        raise ValueError(f"WELCOME field 'router': {capped(r)} is not an object")
    n, k = r.get("num_experts"), r.get("top_k")
    if type(n) is not int or not 1 <= n <= MAX_EXPERTS:
        raise ValueError(
            f"WELCOME field 'router.num_experts': {capped(n)} is not an integer in "
            f"[1, {MAX_EXPERTS}]"
        )
    if type(k) is not int or not 1 <= k <= n:
        raise ValueError(
            f"WELCOME field 'router.top_k': {capped(k)} is not an integer in [1, num_experts={n}]"
        )
    return n, k


@dataclass
class _Layer:
    counts: np.ndarray  # int64 [num_experts]: tokens routed to each expert
    weights: np.ndarray  # float64 [num_experts]: their routing weights, summed
    tokens: int = 0
    bad_rows: int = 0


@dataclass
class ExpertLoad:
    """Per-layer expert load of ``num_experts`` experts, ``top_k`` per token."""

    num_experts: int
    top_k: int
    layers: dict[int, _Layer] = field(default_factory=dict)
    bad_rows: int = 0
    """Rows refused (wrong width, an id not an integer in range, a non-finite number)."""
    layers_overflow_rows: int = 0
    """Rows of layers past ``MAX_LAYERS`` distinct ones: counted here, nowhere else."""

    def __post_init__(self) -> None:
        router_info({"router": {"num_experts": self.num_experts, "top_k": self.top_k}})

    @classmethod
    def from_welcome(cls, welcome: Any) -> ExpertLoad | None:
        """One for the WELCOME's router; None for a model without one."""
        info = router_info(welcome)
        return None if info is None else cls(*info)

    def add(self, layer: int, rows: Any) -> int:
        """Count one message's router rows (``[rows, 2 * top_k]``, a tensor or an array)
        of ``layer``; returns how many were refused."""
        x = np.asarray(rows.numpy() if hasattr(rows, "numpy") else rows)
        n = int(x.shape[0]) if x.ndim >= 1 else 1
        if n == 0:
            return 0
        lay = self.layers.get(layer)
        if lay is None:
            if len(self.layers) >= MAX_LAYERS:
                self.layers_overflow_rows += n
                return 0
            e = self.num_experts
            lay = self.layers[layer] = _Layer(np.zeros(e, np.int64), np.zeros(e, np.float64))
        k = self.top_k
        if x.ndim != 2 or x.shape[1] != 2 * k:
            lay.bad_rows += n
            self.bad_rows += n
            return n
        x = x.astype(np.float64, copy=False)
        ids, w = x[:, :k], x[:, k:]
        ok = (
            np.isfinite(x).all(1)
            & (ids == np.floor(ids)).all(1)
            & (ids >= 0).all(1)
            & (ids < self.num_experts).all(1)
        )
        bad = n - int(ok.sum())
        if bad:
            ids, w = ids[ok], w[ok]
            lay.bad_rows += bad
            self.bad_rows += bad
        flat = ids.astype(np.int64).ravel()
        lay.counts += np.bincount(flat, minlength=self.num_experts)
        lay.weights += np.bincount(flat, weights=w.ravel(), minlength=self.num_experts)
        lay.tokens += n - bad
        return bad

    def snapshot(self) -> dict[str, Any]:
        """JSON-able: per layer (by index, ascending) the tokens counted, each expert's
        token count and weight sum, and the imbalance (the busiest expert's count over
        the mean count: 1.0 is an even load)."""
        layers = {}
        for i in sorted(self.layers):
            lay = self.layers[i]
            mean = lay.counts.sum() / self.num_experts
            layers[str(i)] = {
                "tokens": lay.tokens,
                "bad_rows": lay.bad_rows,
                "counts": lay.counts.tolist(),
                "weights": lay.weights.tolist(),
                "imbalance": float(lay.counts.max() / mean) if mean else 0.0,
            }
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "bad_rows": self.bad_rows,
            "layers_overflow_rows": self.layers_overflow_rows,
            "layers": layers,
        }


def add_expert_load_argument(parser: Any) -> None:
    """``--expert-load`` / ``--no-expert-load``, for both dashboards."""
    parser.add_argument(
        "--expert-load",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when the engine taps a mixture-of-experts router (hook 'router'), also "
        "subscribe to its rows (a few floats per token, drop_newest: never slows the "
        "engine) and show the expert load per layer",
    )
