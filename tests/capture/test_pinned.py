"""Which blocks warm torch's pinned cache: every size class a step's copy can need.

The warming itself needs CUDA (page-locked memory); its effect, no ``cudaHostAlloc``
on the engine's thread while timed, is in bench_journey's cost line (pinned_allocs)."""

from __future__ import annotations

import torch

from actbus.capture import pinned
from actbus.config import CaptureConfig

MIB = 1 << 20


def test_size_class_is_the_next_power_of_two():
    assert pinned.size_class(1) == 1
    assert pinned.size_class(MIB) == MIB
    assert pinned.size_class(MIB + 1) == 2 * MIB
    # The journey's largest step: 8192 rows of hidden 4096 in bf16, one layer.
    assert pinned.size_class(8192 * 4096 * 2) == 64 * MIB


def test_plan_covers_every_class_within_the_budget():
    sizes = pinned.plan(8192 * 4096 * 2, 512 * MIB)
    classes = sorted(set(sizes), reverse=True)
    assert classes == [64 * MIB >> i for i in range(7)]  # 64 MiB down to 1 MiB
    assert all(sizes.count(c) == 4 for c in classes)  # 4 x 127 MiB fits 512
    assert sum(sizes) <= 512 * MIB
    # A step that is not a power of two is served by the class above it.
    assert max(sizes) >= 6000 * 4096 * 2


def test_plan_under_a_small_budget_keeps_the_largest_that_fit():
    sizes = pinned.plan(256 * MIB, 300 * MIB)
    assert sizes[0] == 256 * MIB and sum(sizes) <= 300 * MIB
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert pinned.plan(256 * MIB, 0) == []
    assert pinned.plan(512 * 1024, 512 * MIB) == []  # below 1 MiB: not warmed
    assert len(pinned.plan(MIB, 1 << 40)) == pinned.MAX_PER_CLASS


def test_warm_is_a_no_op_without_cuda():
    if torch.cuda.is_available():
        return
    assert pinned.warm(64 * MIB, 512 * MIB) == 0


def test_config_default_and_off():
    assert CaptureConfig.from_dict({"layers": [1]}).pinned_warm_mb == 512
    assert CaptureConfig.from_dict({"layers": [1], "pinned_warm_mb": 0}).pinned_warm_mb == 0
