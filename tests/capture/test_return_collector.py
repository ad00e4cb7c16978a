"""The front end's collector of returned rows, against a real publisher: DELTA outputs
hand out every row once, in order, and the collector keeps only what is not handed out
yet (the engine-level tests are in test_engine_return.py)."""

from __future__ import annotations

import time

import numpy as np
import torch

from actbus.bus import Publisher
from actbus.capture.returns import ReturnCollector
from actbus.capture.selection import Selection
from actbus.wire import Header, RequestEnd, RowIndex

TAPS = ((0, "post_block"), (3, "post_block"))


def _send(pub: Publisher, step: int, positions: list[int], end: bool = False) -> None:
    ri = RowIndex(
        ["r"],
        np.array([0, len(positions)]),
        np.array(positions),
        np.array(positions) + 100,
        returned=[True],
    )
    ended = [RequestEnd("r", 0, "stop")] if end else []
    for layer, hook in TAPS:
        x = torch.tensor([[float(p) + layer] * 4 for p in positions])
        pub.publish(Header(step, layer, hook, "float32", tuple(x.shape), "m", ri, ended=ended), x)


def test_delta_outputs_hand_out_each_row_once_and_keep_only_the_rest(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    col = ReturnCollector(address)
    prompt, new_tokens = 5, 40
    try:
        col.expect("r", 1, Selection(layers=(0, 3), hooks=("post_block",)), prompt)
        _send(pub, 0, list(range(prompt)))  # the prefill
        got: list[int] = []
        for n in range(1, new_tokens + 1):  # output n: n tokens generated so far
            if n > 1:
                _send(pub, n - 1, [prompt + n - 2])  # the decode step that fed token n-1
            limit = prompt + n - 1
            deadline = time.monotonic() + 10
            while len(got) < limit:  # the rows may still be on their way
                out = col.take("r", 0, n, final=False, delta=True)
                got += out.positions.tolist()
                for layer, hook in TAPS:
                    t = out.tensors[(layer, hook)]
                    assert t[:, 0].tolist() == [p + layer for p in out.positions.tolist()]
                assert time.monotonic() < deadline, (n, got)
            # What was handed out is let go: only rows not yet handed out are held.
            held = col._pending[("r", 0)].chunks
            assert all(sum(len(c[0]) for c in held.get(k, [])) == 0 for k in TAPS), held
        _send(pub, new_tokens, [prompt + new_tokens - 1], end=True)
        last = col.take("r", 0, new_tokens + 1, final=True, delta=True)
        got += last.positions.tolist()
        assert last.complete
        assert got == list(range(prompt + new_tokens))  # every row once, in order
    finally:
        col.close()
        pub.close()
