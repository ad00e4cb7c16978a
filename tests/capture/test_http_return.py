"""The HTTP form of returned rows, its bounds and the client, without an engine
(``tests/capture/test_server.py`` runs them against ``actbus serve``)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from actbus.capture.http import FETCH, HttpReturns, parse_return, to_json, to_safetensors
from actbus.capture.returns import Activations
from actbus.capture.selection import Selection
from actbus.client import returned
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
    position once, in order."""
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
    t1 = b.admit(SEL, 10, 100, 2, row, False)  # 2 x 109 positions x 2 taps x 1 KiB
    assert b.held() == 2 * 109 * 2 * row
    with pytest.raises(ConfigError, match=r"http_return_max_server_mb \(1 MiB\)"):
        b.admit(SEL, 10, 300, 1, row, True)  # 618 KiB more
    b.attach(t1, "a-0")
    b.attach(t1, "a-1")
    b.done(["a-0"])
    assert b.held() == 109 * 2 * row
    del t1
    gc.collect()  # the request's state is gone: whatever is left goes with it
    assert b.held() == 0
    blob = to_safetensors(_acts(5, torch.float32))
    key = b.put(blob)
    assert key and b.held() == len(blob)
    assert b.take(key) == blob and b.take(key) is None and b.held() == 0
    assert b.refused == {"request": 1, "server": 1, "store": 0}


def test_stored_rows_expire():
    b = HttpReturns(MIB, 2 * MIB, ttl_s=0.0)
    key = b.put(b"x" * 100)
    assert b.take(key) is None and b.held() == 0


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
