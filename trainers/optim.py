"""The trainers' optimizer: Adam, fused into one kernel where the parameters allow.

PyTorch's default Adam on CUDA is the multi-tensor ("foreach") form: several passes
over every parameter, its gradient and both moments. An SAE of 16x on d=4096 has
0.5 G parameters, so those passes cost more than a third of a training step on an
H100; the fused form reads and writes each tensor once. Same update, same state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def adam(params: Iterable[Any], **kw: Any) -> torch.optim.Adam:
    """``torch.optim.Adam`` over ``params`` (tensors or parameter groups), fused when
    every parameter is a floating-point CUDA tensor (the fused kernel's condition)."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(p.is_cuda and p.is_floating_point() for p in tensors)
    return torch.optim.Adam(groups, fused=fused or None, **kw)
