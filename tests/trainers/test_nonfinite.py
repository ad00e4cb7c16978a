"""Rows holding a NaN or an infinity are counted and never trained on: a real
publisher process sends them among good rows to the trainers' data module."""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_synth import SynthPublisher
from trainers.config import DataConfig
from trainers.data import ROW_LIMIT, TokenStream, finite_rows


@pytest.mark.timeout(120)
def test_nonfinite_rows_are_counted_and_never_handed_out(tmp_path):
    address = f"ipc://{tmp_path}/synth.sock"
    messages, rows, every = 40, 64, 4
    pub = SynthPublisher(address, messages, "--rows", str(rows), "--nonfinite-every", str(every))
    cfg = DataConfig(
        streams=((0, "post_block"),),
        address=address,
        policy="block",
        window=8,
        batch_tokens=64,
        buffer_tokens=256,
        warmup_tokens=64,
        idle_s=10,
    )
    stream = TokenStream(cfg)
    handed = 0
    try:
        for batch in stream:
            b = batch["L0.post_block"]
            assert bool(torch.isfinite(b["activation"]).all()), "a non-finite row was handed out"
            handed += len(b["request_id"])
    finally:
        stream.close()
        pub.stop()
    s = stream.stats()
    bad = 2 * (messages // every)  # a NaN row and an infinite row in every 4th message
    assert s["bus/received"] == messages and s["bus/missed"] == 0
    assert s["nonfinite/L0.post_block"] == bad  # the metric the trainer logs (data/...)
    assert handed == messages * rows - bad == s["tokens/L0.post_block"] == s["rows_in"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_rows_is_exact_even_where_a_row_sum_overflows(dtype):
    x = torch.ones(5, 64, dtype=dtype)
    assert finite_rows(x) is None
    x[1] = min(torch.finfo(dtype).max / 2, ROW_LIMIT)  # fp16: finite, its sum overflows
    assert finite_rows(x) is None
    x[2, 7], x[3, 0], x[4, 63] = float("nan"), float("inf"), float("-inf")
    assert finite_rows(x).tolist() == [True, True, False, False, False]
