"""The front end's collector of returned scores against a real publisher, no engine:
many requests' scores in one message each land in their own series (DELTA pieces
once each, CUMULATIVE all so far, n>1 samples apart, regions grown past their first
size), and a final output waits only while its scores are on their way (the
engine-level tests are in test_monitor_engine.py and tests/capture/test_return.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from actbus import collector
from actbus.bus import Publisher
from actbus.monitor.returns import ScoreCollector
from actbus.wire import MONITOR_HOOK, Header, MonitorInfo, RequestEnd, RowIndex

STREAMS = (("p", 0), ("f", 2))
WIDTH = {"p": 1, "f": 3}


def _value(key: tuple[str, int], pos: int, col: int) -> float:
    """Names the request, sample, position and column of every score (exact in float32)."""
    return float(int(key[0][1:]) * 10_000 + key[1] * 5_000 + pos * 4 + col)


def _send(pub: Publisher, step: int, fed: dict, ended: list, version: int = 1) -> None:
    """One message per stream: rows ``fed[(rid, sample)]`` of each request."""
    keys = list(fed)
    counts = [len(fed[k]) for k in keys]
    pos = np.concatenate([[], *(fed[k] for k in keys)]).astype(np.int64)
    ri = RowIndex(
        [k[0] for k in keys],
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        pos,
        pos + 100,
        sample_index=[k[1] for k in keys],
        returned=[True] * len(keys),
    )
    ends = [RequestEnd(r, s, "length") for r, s in ended]
    for name, layer in STREAMS:
        w = WIDTH[name]
        x = torch.tensor(
            [[_value(k, int(p), c) for c in range(w)] for k in keys for p in fed[k]],
            dtype=torch.float32,
        ).reshape(-1, w)
        labels = (7, 8, 9) if name == "f" else ()
        hdr = Header(
            step, layer, MONITOR_HOOK, "float32", tuple(x.shape), "m", ri, ended=ends,
            monitor=MonitorInfo(name, version, "post_block", labels),
        )  # fmt: skip
        pub.publish(hdr, x)


def _outputs(col: ScoreCollector, key, n: int, *, delta: bool, want: int, had: int = 0):
    """Outputs made until the scores of ``want`` positions came (a reader polling;
    ``had``: positions DELTA pieces handed out before): every DELTA piece, and the
    last CUMULATIVE one."""
    got: list = []
    deadline = time.monotonic() + 10
    while True:
        out = col.take(key[0], key[1], n, final=False, delta=delta)
        got = [*got, out] if delta else [out]
        have = sum(len(g.positions) for g in got) + (had if delta else 0)
        if have >= want or time.monotonic() > deadline:
            return got


def test_scores_of_many_requests_land_in_their_own_series(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    col = ScoreCollector([address])
    prompts = {"r1": 5, "r2": 3, "r3": 40}
    gen = 30  # more than the 4 + 1 token budget given: regions grow
    delta = {"r1": True, "r2": False, "r3": True}
    samples = [("r1", 0), ("r2", 0), ("r2", 1), ("r3", 0)]
    try:
        col.expect("r1", 1, STREAMS, prompts["r1"], max_tokens=4)
        col.expect("r2", 2, STREAMS, prompts["r2"], max_tokens=4)
        col.expect("r3", 1, STREAMS, prompts["r3"], max_tokens=4)
        col.expect("other", 1, STREAMS[:1], 2)  # never sent: must not take anyone's rows
        fed = {k: list(range(prompts[k[0]])) for k in samples}
        _send(pub, 0, fed, [])
        pieces: dict = {k: [] for k in samples}
        for n in range(1, gen + 1):  # output n: n tokens generated so far
            if n > 1:
                _send(pub, n - 1, {k: [prompts[k[0]] + n - 2] for k in samples}, [])
            for k in samples:
                want = prompts[k[0]] + n - 1
                had = sum(len(g.positions) for g in pieces[k])
                pieces[k] += _outputs(col, k, n, delta=delta[k[0]], want=want, had=had)
        _send(pub, gen, {}, samples)
        for k in samples:
            pieces[k].append(col.take(k[0], k[1], gen, final=True, delta=delta[k[0]]))
        assert col.pending() == 1  # "other" only
        col.forget(["other"])
        assert col.pending() == 0
    finally:
        col.close()
        pub.close()
    for k, got in pieces.items():
        final = got[-1]
        assert final.complete and not any(g.complete for g in got[:-1]), k
        whole = prompts[k[0]] + gen - 1
        if delta[k[0]]:
            pos = torch.cat([g.positions for g in got])
            vals = {s: torch.cat([g.values[s] for g in got if len(g.positions)]) for s in STREAMS}
        else:
            sizes = [len(g.positions) for g in got]
            assert sizes == sorted(sizes), k
            pos, vals = final.positions, final.values
        assert pos.tolist() == list(range(whole)), k  # each position once, in order
        assert (final.token_ids == final.positions + 100).all()
        for s in STREAMS:
            want = [[_value(k, p, c) for c in range(WIDTH[s[0]])] for p in range(whole)]
            assert torch.equal(vals[s], torch.tensor(want, dtype=torch.float32)), (k, s)
        assert final.labels == {"p": (), "f": (7, 8, 9)}
        assert (final.versions[("f", 2)] == 1).all()


def test_a_final_output_waits_only_while_its_scores_come(tmp_path, monkeypatch):
    """Late scores are waited for; scores that never come are given up on once nothing
    has arrived for ``STALL_S`` (not after the 30 s bound), and both are counted."""
    monkeypatch.setattr(collector, "STALL_S", 0.5)
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    col = ScoreCollector([address])
    try:
        col.expect("r1", 1, STREAMS, 3, max_tokens=2)
        col.expect("r2", 1, STREAMS, 3, max_tokens=2)
        _send(pub, 0, {("r1", 0): [0, 1, 2], ("r2", 0): [0, 1, 2]}, [])
        _outputs(col, ("r1", 0), 1, delta=False, want=3)
        assert col.stats()["final_waits"] == 0
        late = threading.Timer(0.3, _send, (pub, 1, {("r1", 0): [3]}, []))
        late.start()
        t0 = time.monotonic()
        out = col.take("r1", 0, 2, final=True, delta=False)  # position 3 is on its way
        assert out.complete and out.positions.tolist() == [0, 1, 2, 3]
        late.join()
        st = col.stats()
        assert st["final_waits"] == 1 and st["final_gave_up"] == 0
        assert 0.2 < st["final_wait_s"] < 5, st
        t0 = time.monotonic()
        out = col.take("r2", 0, 2, final=True, delta=False)  # position 3 never comes
        took = time.monotonic() - t0
        assert not out.complete and out.positions.tolist() == [0, 1, 2]
        assert 0.4 < took < 3, took
        st = col.stats()
        assert st["final_waits"] == 2 and st["final_gave_up"] == 1
        assert col.pending() == 0
        # An output made before any of its scores came: no rows, the configured width
        # (so a reader's DELTA pieces concatenate).
        col.expect("r4", 1, (("f", 2), ("g", 5)), 3, widths={"f": 3, "g": 2})
        out = col.take("r4", 0, 1, final=False, delta=True)
        assert out.values[("f", 2)].shape == (0, 3) and out.values[("g", 5)].shape == (0, 2)
        col.forget(["r4"])
    finally:
        col.close()
        pub.close()


def test_requests_that_share_a_caller_id_get_their_own_scores(tmp_path):
    """Two requests with one caller id (a repeated ``X-Request-Id``) are told apart by
    vLLM's own ids (``engine_ids``), rows and ends alike; the caller id stays on the wire."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 4, "dtype": "float32"})
    col = ScoreCollector([address])
    try:
        for key in ("same-0badcafe", "same-12345678"):
            col.expect(key, 1, STREAMS[:1], 3, max_tokens=2)
        ri = RowIndex(
            ["same", "same"], np.array([0, 3, 6]), np.array([0, 1, 2] * 2), np.arange(6),
            returned=[True, True], engine_ids=["same-12345678", "same-0badcafe"],
        )  # fmt: skip
        ends = [RequestEnd("same", 0, "stop", "same-0badcafe")]
        x = torch.arange(6, dtype=torch.float32).reshape(6, 1)
        info = MonitorInfo("p", 1, "post_block")
        hdr = Header(0, 0, MONITOR_HOOK, "float32", (6, 1), "m", ri, ended=ends, monitor=info)
        pub.publish(hdr, x)
        first = col.take("same-0badcafe", 0, 1, final=True, delta=False)
        assert first.complete and first.values[("p", 0)].flatten().tolist() == [3.0, 4.0, 5.0]
        second = _outputs(col, ("same-12345678", 0), 1, delta=False, want=3)[-1]
        assert second.values[("p", 0)].flatten().tolist() == [0.0, 1.0, 2.0]
        col.forget(["same-12345678"])
        assert col.pending() == 0
    finally:
        col.close()
        pub.close()
