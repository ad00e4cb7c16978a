"""The GPU checks' oracles keep every tensor on the engine rows' device.

A CPU tensor mixed into a CUDA computation fails only on the GPU, minutes into a paid
lease (``check_ops``' gate once multiplied CUDA rows by CPU weights). On the ``meta``
device, mixing devices raises as it does on CUDA, so the oracle's pieces run here on
meta rows: every operation, mode and gate that ``check_ops`` sends. What this cannot
prove: numerics, kernels and the HF model's own forward (run on CUDA in the check).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_check_ops_oracle_runs_on_the_rows_device(tmp_path, seed):
    check_ops = _script("check_ops")
    saes = check_ops._saes(str(tmp_path))
    monitor = (torch.ones(check_ops.HIDDEN) / check_ops.HIDDEN**0.5).tolist()
    seq, prompt_len = 20, 12
    stream = torch.zeros(seq, check_ops.HIDDEN, device="meta")
    acts = {(la, h): stream for la in range(4) for h in check_ops.HOOKS}
    history = {(1, "post_block"): torch.zeros(seq, device="meta")}
    ops = [h for _, hf, _ in check_ops.cases(seed, 3.0, saes, monitor) for h in hf]
    assert {type(h).__name__ for h in ops} >= {"HFReplace", "HFAblate", "HFClamp", "HFSteer"}
    assert any(h.gate is not None for h in ops)
    for h in ops:
        h.to("meta")
        out = h.delta(stream, prompt_len, (acts, history))
        assert out.device.type == "meta" and out.shape == stream.shape, type(h).__name__


def test_a_cpu_tensor_in_the_oracle_fails_on_meta():
    """The dry run can fail: a gate scoring with CPU weights raises on meta rows."""
    from tests.support.steer_oracle import HFGate, HFSteer

    w = torch.ones(8)
    gate = HFGate((0, "post_block"), lambda x: x.float() @ w, 0.0, 4.0)
    steer = HFSteer(0, "post_block", torch.ones(8), gate=gate).to("meta")
    stream = torch.zeros(5, 8, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        steer.delta(stream, 3, ({(0, "post_block"): stream}, {}))
