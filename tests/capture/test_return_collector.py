"""The front end's collector of returned rows, against a real publisher: DELTA outputs
hand out every row once, in order, and the collector keeps only what is not handed out
yet, writing rows batched (a scatter per slab) or per request gives the same rows, and
a streamed chunk awaits its own tokens' rows without blocking the event loop (the
engine-level tests are in test_engine_return.py and capture/test_server.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from actbus import rowstore
from actbus.bus import Publisher
from actbus.capture.returns import Due, ReturnCollector
from actbus.capture.selection import Selection
from actbus.wire import Header, RequestEnd, RowIndex

TAPS = ((0, "post_block"), (3, "post_block"))


def _send(
    pub: Publisher, step: int, positions: list[int], end: bool = False, rid: str = "r"
) -> None:
    ri = RowIndex(
        [rid],
        np.array([0, len(positions)]),
        np.array(positions),
        np.array(positions) + 100,
        returned=[True],
    )
    ended = [RequestEnd(rid, 0, "stop")] if end else []
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


def _send_steps(pub: Publisher, steps: list[dict[str, list[int]]]) -> None:
    """Several requests per step; each row's values name its request, position, layer."""
    for step, fed in enumerate(steps):
        ids = list(fed)
        counts = [len(fed[r]) for r in ids]
        positions = np.array([p for r in ids for p in fed[r]], dtype=np.int64)
        ri = RowIndex(
            ids,
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            positions,
            positions + 100,
            returned=[True] * len(ids),
        )
        owner = [int(r[1:]) for r in ids for _ in fed[r]]
        for layer, hook in TAPS:
            x = torch.tensor(
                [
                    [float(o), float(p), float(layer), 0.5]
                    for o, p in zip(owner, positions, strict=True)
                ]
            )
            pub.publish(Header(step, layer, hook, "float32", tuple(x.shape), "m", ri), x)


@pytest.mark.parametrize("batched", [True, False])
def test_batched_and_per_request_writes_keep_every_row_in_order(tmp_path, monkeypatch, batched):
    """Decode steps' single rows go through the slab scatter (``batched``) or a call
    per request; a request whose rows outgrow its budget, and one whose rows come out
    of order, leave the slab, and so does the last left in a slab whose other requests
    were collected. Every way gives each request every row once, in order."""
    monkeypatch.setattr(ReturnCollector, "batched", batched)
    monkeypatch.setattr(rowstore, "SLAB_BYTES", 180 * 16)  # 5 requests' rows a slab
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    col = ReturnCollector(address)
    prompt, gen, n = 6, 30, 12
    sel = Selection(layers=(0, 3), hooks=("post_block",))
    try:
        for r in range(n):  # r0 asks for 4 tokens but gets 30: it grows
            col.expect(f"r{r}", 1, sel, prompt, max_tokens=4 if r == 0 else gen)
        steps = [{f"r{r}": list(range(prompt)) for r in range(n)}]
        for g in range(gen - 1):
            steps.append({f"r{r}": [prompt + g] for r in range(n)})
        # r1's rows of two steps come swapped: the later one first
        steps[5]["r1"], steps[6]["r1"] = steps[6]["r1"], steps[5]["r1"]
        _send_steps(pub, steps)
        want = list(range(prompt + gen - 1))
        homes: dict[int, list[bool]] = {}
        order = list(range(n))
        for r in order:
            if r == n - 1:  # alone in its first tap's slab now: moved out within a second
                time.sleep(1.5)
                assert col._pending[(f"r{r}", 0)].taps[TAPS[0]].home is None
            if r == 1:  # r0's final output waited for the last message: all are in
                homes = {
                    q: [col._pending[(f"r{q}", 0)].taps[k].home is not None for k in TAPS]
                    for q in range(1, n)
                }
            acts = col.take(f"r{r}", 0, gen, final=True, delta=False)
            assert acts.complete and acts.positions.tolist() == want, r
            assert acts.token_ids.tolist() == [p + 100 for p in want]
            for layer, hook in TAPS:
                t = acts.tensors[(layer, hook)]
                assert t[:, 0].eq(r).all() and t[:, 2].eq(layer).all(), (r, layer)
                assert t[:, 1].tolist() == [float(p) for p in want], (r, layer)
        # In a slab: the batched way's buffers, but r1's (sorted into memory of its own).
        assert homes == {q: [batched and q != 1] * len(TAPS) for q in range(1, n)}
    finally:
        col.close()
        pub.close()


def test_a_chunk_awaits_its_own_rows_without_blocking_the_loop(tmp_path):
    """A streamed sample's outputs owe rows (``Due``) that its chunks take: a chunk
    awaits its tokens' rows while the event loop runs on; past its bound it goes with
    what came (``late`` counts the rest) and the next chunk carries them; the final
    chunk says ``complete`` and lets the sample go; a sample let go (an abort) ends
    its chunk's wait at once."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    col = ReturnCollector(address)
    sel = Selection(layers=(0, 3), hooks=("post_block",))
    prompt = 5

    async def stream() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        beat = asyncio.create_task(ticker())
        loop = asyncio.get_running_loop()
        col.expect("r", 1, sel, prompt, max_tokens=8, chunked=True)
        first = col.take("r", 0, 1, final=False, delta=True)  # its first token: the prompt's
        assert isinstance(first, Due) and first.limit == prompt
        loop.call_later(0.2, _send, pub, 0, list(range(prompt)))
        acts, waited = await col.rows_for(first, 60.0)
        assert acts.positions.tolist() == list(range(prompt)) and acts.late == 0
        assert waited > 0 and ticks > 10, (waited, ticks)  # the loop ran meanwhile
        _send(pub, 1, [5])  # tokens 2 and 3 owe positions 5 and 6; 6 is late
        acts, waited = await col.rows_for(col.take("r", 0, 3, final=False, delta=True), 0.2)
        assert acts.positions.tolist() == [5] and acts.late == 1 and waited > 0
        _send(pub, 2, [6])
        _send(pub, 3, [7], end=True)
        last = col.take("r", 0, 4, final=True, delta=True)
        acts, _ = await col.rows_for(last, 0.0)
        assert acts.positions.tolist() == [6, 7] and acts.complete and acts.late == 0
        assert acts.tensors[(3, "post_block")][:, 0].tolist() == [9.0, 10.0]
        assert col.pending() == 0  # let go by its last chunk
        col.expect("q", 1, sel, 3, chunked=True)
        due = col.take("q", 0, 1, final=False, delta=True)
        loop.call_later(0.1, col.forget, ["q"])
        acts, _ = await asyncio.wait_for(col.rows_for(due, 60.0), 30)
        assert acts is None
        beat.cancel()

    try:
        asyncio.run(stream())
    finally:
        col.close()
        pub.close()
