"""HTTP clients that ask rows back and never read the answer (issue 45, 2), against a
real ``actbus serve`` whose answers are large enough (megabytes) to outgrow what the
kernel's socket buffers take, so what the server holds for them shows in its memory.

A call's reservation used to end when its final output was made, not when its bytes
were sent: each client that did not read kept its whole response in the API server,
which grew with the number of such connections. And the front end's row store faulted
in a whole spare slab (256 MiB) for the first row returned, resident while any request
was pending: a streamed call's 200 comes before its rows are made, so, looked at then,
the server had grown far past the cap that held its unread calls (``actbus.rowstore``
now faults in about what is used). Its peak memory is what is measured, so growth that
comes and goes between two looks shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import actbus_serve, wait_for
from tests.support.rawhttp import (
    api_server,
    body_started,
    peak_rss,
    post_unread,
    reset_peak,
    returns_stats,
    status_of,
)

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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_unread_return_responses_hold_no_more_than_the_server_cap(server, stream):
    """Clients, one after another, each sending a ``"return": true`` call (4 samples x
    500 positions x 4 taps: 4 MiB of rows) and reading nothing: 100 whole answers, 20
    streamed ones. A call's reservation lasts until its response is sent, so the server
    holds no more than its cap (``http_return_max_server_mb``): three calls fit, and
    those past it are refused, counted and naming the cap; a whole call with a 400, a
    streamed one in its stream (vLLM sends its 200 before it reads the prompts). The
    API server's peak memory, from the first call until every answer has begun, grows by
    no more than that cap plus 50 MiB (it grew with every client: by hundreds of MiB
    here; and streamed, while the rows were made, by the 256 MiB the row store faulted
    in ahead of use for the first row returned). Once they hang up, the reservations
    and the memory are given back, and a call that reads its answer is served."""
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
    reset_peak(api)
    refused0 = returns_stats(base)["refused"]["server"]
    socks, statuses, begun = [], [], []
    try:
        for _ in range(clients):  # one after another: each answered before the next asks
            socks.append(post_unread(base, "/v1/completions", body))
            statuses.append(status_of(socks[-1], 300))
        begun = [body_started(s, 300) for s in socks]  # streamed: rows made, or refused
        stats = returns_stats(base)
        grown = peak_rss(api) - rss0
        assert grown <= (SERVER_MB + 50) * MIB, f"grew {grown / MIB:.0f} MiB at its peak"
    finally:
        for s in socks:
            s.close()
    assert stats["held_bytes"] <= SERVER_MB * MIB, stats
    assert stats["refused"]["server"] - refused0 == clients - 3, stats
    naming = sum(b"http_return_max_server_mb" in got for got in begun)
    assert naming == clients - 3, begun[-1][-600:]
    if stream:  # its head went before its prompts were read: refused in the stream
        assert statuses == [200] * clients, statuses
    else:
        assert statuses.count(200) == 3 and statuses.count(400) == clients - 3, statuses
    wait_for(lambda: returns_stats(base)["held_bytes"] == 0, 60, "the reservations to go")
    wait_for(lambda: api.memory_info().rss - rss0 <= 50 * MIB, 60, "the memory to go back")
    read = post_unread(base, "/v1/completions", body)
    assert status_of(read, 120) == 200
    read.close()
