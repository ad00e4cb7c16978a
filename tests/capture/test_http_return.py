"""The HTTP form of returned rows, its bounds and the client, without an engine
(``tests/capture/test_server.py`` runs them against ``actbus serve``)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from actbus.capture.calls import HttpCall
from actbus.capture.http import (
    FETCH,
    HttpReturns,
    b64_len,
    parse_return,
    to_json,
    to_safetensors,
)
from actbus.capture.returns import Activations
from actbus.capture.selection import Selection
from actbus.client import pieces, returned
from actbus.errors import ConfigError

MIB = 1 << 20
SEL = Selection((0, 3), ("post_block",), "all", {}, True)


def _acts(n: int, dtype: torch.dtype, start: int = 0) -> Activations:
    g = torch.Generator().manual_seed(start)
    return Activations(
        torch.arange(start, start + n),
        torch.arange(100 + start, 100 + start + n),
        {(0, "post_block"): torch.randn(n, 8, generator=g).to(dtype),
         (3, "post_block"): torch.randn(n, 8, generator=g).to(dtype)},
        complete=True,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inline_rows_read_back_bitwise_plain_and_streamed(dtype):
    """A choice's JSON rows decode to the same bits, whole or as a stream's pieces (SSE
    text, chunks as dicts; a chunk whose tokens brought no new rows among them), each
    position once, in order; ``pieces`` gives each chunk's own, with its ``late``."""
    whole = _acts(7, dtype)
    body = {"choices": [{"index": 0, "actbus": {"activations": to_json(whole, True)}}]}
    got = returned(json.loads(json.dumps(body)))[0]
    assert got.positions.tolist() == list(range(7)) and got.complete is True
    for k, t in whole.tensors.items():
        assert got[k].dtype == dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8))
    first, none, then = _acts(3, dtype), _acts(0, dtype, start=3), _acts(4, dtype, start=3)
    sse = "".join(
        "data: " + json.dumps({"choices": [{"index": 1, "actbus": {
            "activations": to_json(a, final)}}]}) + "\n\n"
        for a, final in ((first, False), (none, False), (then, True))
    ) + "data: [DONE]\n\n"  # fmt: skip
    got = returned(sse)[1]
    assert got.positions.tolist() == list(range(7)) and got.complete is True
    assert torch.equal(got[(3, "post_block")][3:], then.tensors[(3, "post_block")])
    first.late = 2  # went without two rows of its tokens: the next chunk carries them
    assert "late" not in to_json(none, False) and to_json(first, False)["late"] == 2
    sse = "".join(
        "data: " + json.dumps({"choices": [{"index": 0, "actbus": {
            "activations": to_json(a, final)}}]}) + "\n\n"
        for a, final in ((first, False), (then, True))
    )  # fmt: skip
    own = [(i, p.positions.tolist(), p.late) for i, p in pieces(sse)]
    assert own == [(0, [0, 1, 2], 2), (0, [3, 4, 5, 6], 0)]


def test_rows_that_do_not_add_up_are_refused():
    entry = to_json(_acts(2, torch.float32), True)
    entry["rows"][0]["shape"] = [3, 8]
    with pytest.raises(ValueError, match=r"bytes do not make \[3, 8\]"):
        returned({"choices": [{"index": 0, "actbus": {"activations": entry}}]})


def test_return_values_an_http_caller_may_send():
    assert parse_return(True) == (True, "inline") and parse_return(FETCH) == (True, FETCH)
    assert parse_return(False) == (False, None)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"extra_args\.actbus\.return: expected true"):
            parse_return(bad)


def test_the_limits_name_themselves_and_reservations_are_let_go():
    """Per request, then per server; a reservation is let go by each sample's end and,
    whatever happens, with its ticket; stored rows count until fetched, once."""
    b = HttpReturns(MIB, MIB, ttl_s=300)
    row = 1024
    with pytest.raises(ConfigError, match=r"http_return_max_request_mb \(1 MiB\)"):
        b.admit(SEL, 10, 600, 1, row, False)  # 609 positions x 2 taps x 1 KiB
    t1 = b.admit(SEL, 10, 100, 2, row, False)  # 2 x 109 positions x 2 taps x 1 KiB, base64
    assert b.held() == 2 * 2 * b64_len(109 * row)
    with pytest.raises(ConfigError, match=r"http_return_max_server_mb \(1 MiB\)"):
        b.admit(SEL, 10, 300, 1, row, True)  # 618 KiB more (raw: kept for fetching)
    b.attach(t1, "a-0")
    b.attach(t1, "a-1")
    b.done(["a-0"])
    assert b.held() == 2 * b64_len(109 * row)
    del t1
    gc.collect()  # the request's state is gone: whatever is left goes with it
    assert b.held() == 0
    blob = to_safetensors(_acts(5, torch.float32))
    key = b.put(blob)
    assert key and b.held() == len(blob)
    assert b.take(key) == blob and b.take(key) is None and b.held() == 0
    assert b.refused == {"request": 1, "server": 1, "client": 0, "store": 0}


def test_the_server_refusal_counts_the_calls_own_prompts_as_its_own():
    """Issue 50: a call whose own earlier prompts filled the server's limit was told the
    server held those rows "for other HTTP responses"; they are this call's."""
    b = HttpReturns(2 * MIB, MIB, ttl_s=300, max_client=MIB)
    row = 1024
    call = HttpCall("10.0.0.1")
    for _ in range(3):
        b.admit(SEL, 10, 100, 1, row, False, call)  # 0.28 MiB each, as base64
    with pytest.raises(ConfigError) as e:
        b.admit(SEL, 10, 100, 1, row, False, call)  # within 2 MiB a call, past 1 MiB held
    msg = str(e.value)
    assert "holds 0.00 MiB of rows for other HTTP calls" in msg, msg
    assert "this call's 1.14 MiB would pass its http_return_max_server_mb (1 MiB)" in msg, msg
    b.end_call(call)
    assert b.held() == 0


def test_one_call_is_bounded_over_its_prompts_and_held_until_sent():
    """The prompts of one HTTP call count together against the per-request limit, and
    a refusal names the call's own total; the server's refusal counts only other calls'
    rows as others'. A call's reservation outlives its final outputs until the call
    ends; rows kept for fetching take their sample's place, shared out by client."""
    b = HttpReturns(MIB, 3 * MIB // 2, ttl_s=300, max_client=MIB // 2)
    row = 1024
    call = HttpCall("10.0.0.1")
    first = b.admit(SEL, 10, 100, 1, row, False, call)  # 2 taps x base64 of 109 KiB: 0.28 MiB
    b.admit(SEL, 10, 100, 2, row, False, call)
    with pytest.raises(ConfigError) as e:
        b.admit(SEL, 10, 100, 1, row, False, call)
    msg = str(e.value)
    assert "this HTTP call's 4 prompts" not in msg and "this HTTP call's 3 prompts" in msg, msg
    assert "1.14 MiB of rows back in all (its prompt 2: 0.28 MiB" in msg, msg
    assert "http_return_max_request_mb (1 MiB)" in msg, msg
    b.attach(first, "c-0")
    b.done(["c-0"])  # its final output: still held, its bytes are not sent yet
    assert b.held() == 3 * 2 * b64_len(109 * row)
    other = HttpCall("10.0.0.2")
    with pytest.raises(ConfigError, match=r"holds 0\.85 MiB of rows for other HTTP calls"):
        b.admit(SEL, 10, 250, 1, row, False, other)  # 0.67 MiB more: past 1.5 MiB
    b.end_call(call)
    assert b.held() == 0
    fetched = b.admit(SEL, 10, 100, 1, row, True, other)  # 218 KiB, raw
    b.attach(fetched, "f-0")
    b.done(["f-0"])
    with pytest.raises(ConfigError, match=r"this client \(10\.0\.0\.2\).*fetch_client_mb"):
        b.admit(SEL, 10, 200, 1, row, True, other)  # 418 KiB more: past its 512 KiB
    key = b.put(b"x" * 1000, "f-0")  # kept: in place of its reservation
    assert b.held() == 1000 and b.stats()["stored_by_client"] == {"10.0.0.2": 1000}
    b.end_call(other)
    assert b.held() == 1000 and b.take(key) == b"x" * 1000 and b.held() == 0
    assert b.refused == {"request": 1, "server": 1, "client": 1, "store": 0}


def test_stored_rows_expire():
    b = HttpReturns(MIB, 2 * MIB, ttl_s=0.0)
    key = b.put(b"x" * 100)
    assert b.take(key) is None and b.held() == 0
    assert b.stats()["expired"] == 1 and b.stats()["expired_bytes"] == 100  # counted


def test_the_fetch_endpoint_asks_for_the_api_key(monkeypatch):
    """``GET /v1/actbus/returns/ID`` through actbus's middleware on a real app: the
    completions' key (not enough without it), then the rows once, then a 404."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from actbus.capture import http
    from actbus.engine import routes

    bounds = HttpReturns(MIB, MIB, ttl_s=300)
    monkeypatch.setattr(http, "_ONE", bounds)
    monkeypatch.delenv("ACTBUS_ADMIN_KEY", raising=False)
    app = FastAPI()
    app.middleware("http")(routes.middleware)
    app.state.args = SimpleNamespace(api_key="completions-key")
    blob = to_safetensors(_acts(3, torch.float32))
    key = bounds.put(blob)
    path = http.FETCH_PATH + key
    with TestClient(app) as c:
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = {"Authorization": "Bearer completions-key"}
        r = c.get(path, headers=ok)
        assert r.status_code == 200 and r.content == blob
        assert c.get(path, headers=ok).status_code == 404
        assert c.get(http.FETCH_PATH + "x" * 500, headers=ok).status_code == 404
