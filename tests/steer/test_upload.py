"""The steering tables' host-to-device copies (``actbus.steer.worker._Upload``) reuse
their pinned staging buffers once a copy has run, and never while it may still run.

The CUDA side is stood in for on CPU: the pinned allocation and the copy's event are
the two calls the pool makes to CUDA, replaced here by plain memory and an event whose
completion the test decides (GPU behaviour itself: ``tests/gpu/check_steer.py``)."""

from __future__ import annotations

import torch

from actbus.steer.worker import _Upload


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _Pool(_Upload):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cuda = True
        self.allocated = 0
        self.events: list[_Event] = []

    def _pinned(self, size: int) -> torch.Tensor:
        self.allocated += 1
        return torch.empty(size, dtype=torch.uint8)

    def _recorded(self) -> _Event:
        self.events.append(_Event())
        return self.events[-1]


def test_staging_buffers_are_reused_only_after_their_copy_ran():
    up = _Pool()
    dst = torch.zeros(3, 5, dtype=torch.float32)
    up(dst, torch.arange(15, dtype=torch.float32).view(3, 5))
    assert torch.equal(dst, torch.arange(15, dtype=torch.float32).view(3, 5))
    up(dst, torch.ones(3, 5))  # the first copy has not run: a second buffer
    assert up.allocated == 2
    up.events[0].done = True
    up(dst[:2], torch.full((2, 5), 7.0))  # the first one's buffer, reused (same size class)
    assert up.allocated == 2 and torch.equal(dst[:2], torch.full((2, 5), 7.0))
    for e in up.events:
        e.done = True
    idx = torch.zeros(4, 2, dtype=torch.int64)
    up(idx, torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]))  # another dtype, same pool
    assert up.allocated == 2 and idx.flatten().tolist() == list(range(1, 9))
    big = torch.zeros(4096)
    up(big, torch.ones(4096))  # 16 KiB: a larger size class, a new buffer
    assert up.allocated == 3 and float(big.sum()) == 4096
