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


def test_collectors_of_a_stopped_engine_are_closed(tmp_path, caplog):
    """Once its engine stopped, a collector would wait for the publisher (and log that it
    waits) for as long as the process lives: the front end's shutdown closes it."""
    from actbus.capture import returns

    address = f"ipc://{tmp_path}/bus.sock"
    other = f"ipc://{tmp_path}/other.sock"
    pubs = [Publisher(a, info={"model": "m", "hidden_size": 4}) for a in (address, other)]
    cols = [ReturnCollector(a) for a in (address, other)]
    returns._COLLECTORS.update({address: cols[0], other: cols[1]})
    try:
        cols[0].expect("r", 1, Selection(layers=(0,), hooks=("post_block",)), 3)
        assert returns.collector_for("r") is cols[0]
        assert returns.close_collectors([address]) == 1
        assert not cols[0]._thread.is_alive() and cols[1]._thread.is_alive()
        assert address not in returns._COLLECTORS and other in returns._COLLECTORS
        assert returns.collector_for("r") is None
        pubs[0].close()
        time.sleep(6)  # a live subscriber says it still waits every 5 s
        assert "no publisher has answered at " + address not in caplog.text
    finally:
        returns._COLLECTORS.pop(other, None)
        for c in cols:
            c.close()
        for p in pubs:
            p.close()
