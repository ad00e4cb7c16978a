"""HTTP clients that ask rows back and never read the answer (issue 45, 2), against a
real ``actbus serve`` whose answers are large enough (megabytes) to outgrow what the
kernel's socket buffers take, so what the server holds for them shows in its memory.

A call's reservation used to end when its final output was made, not when its bytes
were sent: each client that did not read kept its whole response in the API server,
which grew with the number of such connections.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import actbus_serve, wait_for
from tests.support.rawhttp import api_server, post_unread, returns_stats, status_of

pytestmark = pytest.mark.engine
MIB = 1 << 20
SERVER_MB = 20
"""``http_return_max_server_mb``: three of this module's calls fit (4 MiB of rows each,
5.3 MiB as base64 text)."""


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unread")
    model = Path(tiny_models["llama"])
    args = [
        "--layers", "0,3", "--hooks", "post_block,mlp_out", "--requests", "selected",
        "--publish", f"ipc://{tmp}/bus.sock", "--dtype", "float32",
        "--max-model-len", "512", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.3",
        "--num-gpu-blocks-override", "64", "--enforce-eager",
        "--actbus-config", json.dumps({
            "http_return_max_request_mb": 16, "http_return_max_server_mb": SERVER_MB,
        }),
    ]  # fmt: skip
    with actbus_serve(model, tmp / "server.log", *args) as (base, proc):
        yield base, proc, model


@pytest.mark.parametrize(
    "stream",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                reason="issue 45 (open): streamed unread return calls are all admitted and "
                "the API server grew 170 MiB for 20 of them in a full suite run (cap 20 MiB "
                "+ 50); their rows are not yet held to the server's cap",
                strict=False,
            ),
        ),
    ],
    ids=["whole", "streamed"],
)
def test_unread_return_responses_hold_no_more_than_the_server_cap(server, stream):
    """Clients, one after another, each sending a ``"return": true`` call (4 samples x
    500 positions x 4 taps: 4 MiB of rows) and reading nothing: 100 whole answers, 20
    streamed ones. A call's reservation lasts until its response is sent, so the server
    holds no more than its cap (``http_return_max_server_mb``): whole answers past it are
    refused, counted; streamed ones are admitted, and what the server holds for them
    stays within the cap. The API server grows by no more than that cap plus 50 MiB (it
    grew with every client: by hundreds of MiB here, +129 MiB for 4 streamed ones).
    Once they hang up, the reservations and the memory are given back, and a call that
    reads its answer is served."""
    base, proc, model = server
    clients = 20 if stream else 100
    api = api_server(proc.pid)
    body = {"model": str(model), "prompt": [7] * 500, "max_tokens": 1, "n": 4,
            "stream": stream,
            "vllm_xargs": {"actbus": json.dumps({"return": True})}}  # fmt: skip
    wait_for(lambda: returns_stats(base)["held_bytes"] == 0, 60, "earlier reservations to go")
    warm = post_unread(base, "/v1/completions", body)  # one, read whole, first
    warm.settimeout(120)
    while warm.recv(1 << 16):
        pass
    warm.close()
    rss0 = api.memory_info().rss
    refused0 = returns_stats(base)["refused"]["server"]
    socks, statuses = [], []
    try:
        for _ in range(clients):  # one after another: each answered before the next asks
            socks.append(post_unread(base, "/v1/completions", body))
            statuses.append(status_of(socks[-1], 300))
        grown = api.memory_info().rss - rss0
        sent = statuses.count(200)
        assert grown <= (SERVER_MB + 50) * MIB, f"grew {grown / MIB:.0f} MiB; {sent} answered"
        stats = returns_stats(base)
    finally:
        for s in socks:
            s.close()
    assert sent + statuses.count(400) == clients, statuses
    assert stats["held_bytes"] <= SERVER_MB * MIB, stats
    if not stream:  # a whole answer reserves its upper bound at admission
        assert sent == 3 and stats["refused"]["server"] - refused0 == clients - sent, stats
    wait_for(lambda: returns_stats(base)["held_bytes"] == 0, 60, "the reservations to go")
    wait_for(lambda: api.memory_info().rss - rss0 <= 50 * MIB, 60, "the memory to go back")
    read = post_unread(base, "/v1/completions", body)
    assert status_of(read, 120) == 200
    read.close()
