"""``actbus serve``: the OpenAI-compatible server with capture, driven by the openai client.

Started as users start it, in its own process; the engine taps two layers and
captures only requests that ask (``--requests selected``), over HTTP through
``vllm_xargs={"actbus": "<json>"}``, which steers requests too. The last test stops it
with Ctrl-C (SIGINT), as a user would, and checks the stream ended for its subscribers.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from actbus.bus import Event, Subscriber, Subscription
from actbus.bus.statsview import request as stats_of
from actbus.cli import consumer_command
from tests.capture.hostile_http import OUTSIDE, Case, corpus, number_cases
from tests.support.monitors import ScoreLog, as_f32, max_rel, raw_expected, raw_monitor
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.procs import ROOT, actbus_serve, wait_for
from tests.support.rawhttp import metric, post_unread, returns_stats, status_of
from tests.support.recorder import RowRecorder

pytestmark = pytest.mark.engine
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # fixed, not the model's
LAYERS, HOOKS = [0, 3], ["post_block", "mlp_out"]
REQUEST_MB, SERVER_MB, CLIENT_MB = 0.6, 1, 0.5
"""The server's ``http_return_max_request_mb``, ``http_return_max_server_mb`` and
``http_return_fetch_client_mb``: a request of 4 taps x 229 float32 rows of the tiny
Llama (hidden 128: 0.45 MiB, 0.6 as base64) fits; kept for fetching, two fit the server
(from two clients), three do not."""


CHUNK_WAIT_S = 10.0
"""The server's ``http_return_chunk_wait_s``."""
ADMIN = "admin-key-of-the-test-server"
"""The steering endpoints' key (``--actbus-admin-key``); completions need none."""


@dataclass
class Server:
    base: str
    address: str
    model: Path
    proc: subprocess.Popen
    log: Path
    vectors: Path
    """The server's one vector directory (``actbus.steer.vector_dirs``)."""


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    address = f"ipc://{tmp}/bus.sock"
    (tmp / "chat.jinja").write_text(TEMPLATE)
    vectors = vector_dir(tmp, Path(tiny_models["llama"]))
    args = [
        "--layers", ",".join(map(str, LAYERS)), "--hooks", ",".join(HOOKS),
        "--requests", "selected", "--publish", address,
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.3", "--num-gpu-blocks-override", "64",
        "--chat-template", str(tmp / "chat.jinja"),
        # The server's paths are under test, not the compiled graph (the session engines
        # capture with torch.compile on): eager starts in half the time on CPU.
        "--enforce-eager", "--actbus-admin-key", ADMIN,
        "--enable-scale-out",  # vLLM's /inference/v1/generate: another HTTP route in
        "--actbus-config", json.dumps({
            "steer": {"layers": [1, 2], "hooks": ["post_block"], "vector_dirs": [str(vectors)]},
            "monitor": {"monitors": server_monitors(tiny_models["llama"])},
            # Small bounds, so requests of this module's size meet them (a row: 512 bytes).
            "http_return_max_request_mb": REQUEST_MB, "http_return_max_server_mb": SERVER_MB,
            "http_return_fetch_client_mb": CLIENT_MB,
            # A streamed chunk waits this long for its rows (0.25 s by default), so that
            # on a loaded machine each still carries exactly its own (none came late).
            "http_return_chunk_wait_s": CHUNK_WAIT_S,
        }),
    ]  # fmt: skip
    model, log = Path(tiny_models["llama"]), tmp / "server.log"
    with actbus_serve(model, log, *args) as (base, proc):
        yield Server(base, address, model, proc, log, vectors)


def vector_dir(tmp: Path, model: Path) -> Path:
    """The server's vector directory: one good file, and links out of it (to the
    model's own weights, to the directory above)."""
    from safetensors.torch import save_file

    out = tmp / "vectors"
    out.mkdir()
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    save_file({"v": torch.linspace(-1, 1, hidden)}, str(out / "good.safetensors"))
    (out / "weights.safetensors").symlink_to(model / "model.safetensors")
    (out / "up").symlink_to(tmp)
    return out


def server_monitors(model_path) -> dict:
    """The server's monitors: raw directions, one at two layers, one through a sigmoid."""
    return {
        "drift": raw_monitor(model_path, 21, [0, 3], bias=-0.5),
        "gate": raw_monitor(model_path, 22, [2], hook="mlp_out", sigmoid=True),
    }


def _call(
    base: str, method: str, path: str, body=None, key: str | None = ADMIN
) -> tuple[int, dict]:
    """One call to actbus's steering endpoints, with the admin key: (status, JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}/v1/actbus/{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _selection(**kw) -> dict:
    return {"vllm_xargs": {"actbus": json.dumps(kw)}}


def test_two_concurrent_clients_get_their_rows(server):
    import openai

    base, address, model_path = server.base, server.address, server.model
    col = RowRecorder(address)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
            rng = random.Random(k)
            got = []
            for i in range(4):
                prompt = [rng.randrange(3, 400) for _ in range(10 + 13 * i)]
                extra = _selection(tags={"client": k, "i": i}) if i < 3 else {}
                r = c.completions.create(
                    model=str(model_path), prompt=prompt, max_tokens=6, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
                )  # fmt: skip
                got.append((prompt, r.choices[0], i < 3))
            results[k] = got
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
        assert len(results) == 2
        col.wait(lambda c: len(c.ended) >= 6, 60, "six captured requests to end")
    finally:
        col.close()
    by_tags = {(t["client"], t["i"]): key for key, t in col.tags.items()}
    assert len(col.ended) == 6, "requests without a selection must not be captured"
    for k, got in results.items():
        for i, (prompt, choice, captured) in enumerate(got):
            if not captured:
                assert (k, i) not in by_tags
                continue
            rid, sample = by_tags[(k, i)]
            fed = (prompt + list(choice.token_ids))[:-1]
            ref = hf_activations(model_path, fed, LAYERS, HOOKS)
            for layer in LAYERS:
                for hook in HOOKS:
                    pos, tok, acts = col.get(rid, layer, hook, sample)
                    assert pos.tolist() == list(range(len(fed))), (k, i, layer, hook)
                    assert tok.tolist() == fed, (k, i)
                    assert max_rel_error(acts, ref[(layer, hook)]) <= 1e-3


def test_bad_selection_is_http_400_and_others_are_served(server):
    import openai

    base, address, model_path = server.base, server.address, server.model
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
    col = RowRecorder(address)
    done: list = []

    def good() -> None:
        r = c.completions.create(
            model=str(model_path), prompt=[5, 6, 7, 8], max_tokens=32, temperature=0,
            extra_body={"ignore_eos": True, **_selection(tags={"good": 1})},
        )  # fmt: skip
        done.append(r)

    t = threading.Thread(target=good)
    try:
        t.start()
        for raw, needle in (
            ({"layers": [2]}, "extra_args.actbus.layers[0]: layer 2 is not tapped"),
            ({"hooks": ["resid"]}, "extra_args.actbus.hooks[0]: unknown hook 'resid'"),
            ({"positions": {"a": 1}}, "extra_args.actbus.positions: expected one of"),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(
                    model=str(model_path), prompt=[5, 6, 7], max_tokens=4,
                    extra_body={"vllm_xargs": {"actbus": json.dumps(raw)}},
                )  # fmt: skip
            assert e.value.status_code == 400 and needle in str(e.value), str(e.value)
        t.join(timeout=120)
        assert done and done[0].choices[0].finish_reason == "length"
        col.wait(lambda c: any(v == {"good": 1} for v in c.tags.values()) and c.ended, 60)
    finally:
        col.close()
    ((rid, sample),) = [k for k, v in col.tags.items() if v == {"good": 1}]
    pos, _, _ = col.get(rid, 3, "post_block", sample)
    assert pos.tolist() == list(range(4 + 31))


def _ret(tag: str, **kw) -> dict:
    """An actbus entry asking rows back, tagged to find its rows on the bus."""
    return {"vllm_xargs": {"actbus": json.dumps({"tags": {"t": tag}, "return": True, **kw})}}


def _check_rows(server, rec: RowRecorder, tag: str, got, fed_len: int, keys, positions=None):
    """One choice's returned rows: exactly its taps and positions, bitwise what a bus
    subscriber got for its sample, HF's within the oracle's tolerance."""
    samples = sorted(k for k, v in rec.tags.items() if v == {"t": tag})
    assert samples, tag
    want = list(range(fed_len)) if positions is None else positions
    assert got.positions.tolist() == want, (tag, got.positions.tolist()[:8], fed_len)
    assert got.complete is True and set(got.tensors) == set(keys), (tag, set(got.tensors))
    rid = sample = None
    for rid, sample in samples:  # the sample whose tokens these are (n=2: one of two)
        pos, tok, _ = rec.get(rid, *keys[0], sample)
        if pos.tolist() == want and tok.tolist() == got.token_ids.tolist():
            break
    else:
        raise AssertionError(f"{tag}: no sample on the bus has these tokens")
    fed = got.token_ids.tolist()
    assert len(fed) == len(want)
    layers, hooks = sorted({k[0] for k in keys}), sorted({k[1] for k in keys})
    if positions is None:
        ref = hf_activations(server.model, fed, layers, hooks)
    for layer, hook in keys:
        pos, tok, acts = rec.get(rid, layer, hook, sample)
        assert pos.tolist() == want and tok.tolist() == fed, (tag, layer, hook)
        mine = got[(layer, hook)]
        assert mine.dtype == acts.dtype and torch.equal(
            mine.view(torch.int32), acts.view(torch.int32)
        )
        if positions is None:
            assert max_rel_error(mine, ref[(layer, hook)]) <= 1e-3, (tag, layer, hook)
    return rid, sample


def test_returned_rows_over_http(server):
    """``"return": true`` over HTTP (issue 38): completions and chat, plain and streamed,
    n=2, and two concurrent requests with their own layers and positions (one through
    httpx, streamed, one through requests): every choice's rows are exactly its own,
    bitwise what a bus subscriber got, and HF's; a stream's chunks carry each position
    once."""
    import httpx
    import openai
    import requests

    from actbus.client import returned

    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=120, max_retries=0)
    model = str(server.model)
    rng = random.Random(38)
    prompt = [rng.randrange(3, 400) for _ in range(21)]
    all_keys = [(layer, hook) for layer in LAYERS for hook in HOOKS]
    rec = RowRecorder(server.address)
    got: dict[str, tuple] = {}  # tag -> (choices' Returned, fed lengths, keys, positions)
    pieces: dict[str, int] = {}
    try:
        r = c.completions.create(
            model=model, prompt=prompt, max_tokens=5, temperature=1.0, n=2,
            extra_body={"ignore_eos": True, "return_token_ids": True, **_ret("full")},
        )  # fmt: skip
        back = returned(r)
        assert sorted(back) == [0, 1]
        got["full"] = (back, [21 + len(ch.token_ids) - 1 for ch in r.choices], all_keys, None)
        chunks = list(
            c.completions.create(
                model=model, prompt=prompt[:13], max_tokens=7, temperature=1.0, n=2,
                stream=True, extra_body={"ignore_eos": True, **_ret("stream", layers=[3])},
            )
        )  # fmt: skip
        back = returned(chunks)
        keys3 = [(3, h) for h in HOOKS]
        got["stream"] = (back, [13 + 7 - 1] * 2, keys3, None)
        pieces["stream"] = sum(1 for ch in chunks for x in ch.choices if _extra(x))
        msgs = [{"role": "user", "content": "the quick brown fox"}]
        one = _ret("chat", layers=[0], hooks=["mlp_out"])
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=5, extra_body={
            "ignore_eos": True, **one})  # fmt: skip
        used = r.usage.prompt_tokens + r.usage.completion_tokens - 1
        got["chat"] = (returned(r), [used], [(0, "mlp_out")], None)
        both = {"ignore_eos": True, **_ret("chat_stream", **MONITORED)}
        chunks = list(c.chat.completions.create(
            model=model, messages=msgs, max_tokens=6, stream=True, extra_body=both))  # fmt: skip
        back = returned(chunks)
        got["chat_stream"] = (back, [len(back[0].positions)], all_keys, None)
        pieces["chat_stream"] = sum(1 for ch in chunks for x in ch.choices if _extra(x))
        assert set(back[0].scores) == {("drift", 0), ("drift", 3), ("gate", 2)}
        assert back[0].score_positions.tolist() == back[0].positions.tolist()
        # Two at once, each with its own layers and positions.
        bodies = {
            "a": ([9, 8, 7, 6, 5, 4, 3], _ret("a", layers=[0], hooks=["post_block"]), True),
            "b": ([11, 12, 13, 14, 15], _ret("b", layers=[3], positions=[1, 4, 9]), False),
        }
        out: dict[str, object] = {}

        def send(tag: str) -> None:
            p, extra, stream = bodies[tag]
            body = {"model": model, "prompt": p, "max_tokens": 8, "ignore_eos": True,
                    "stream": stream, **extra}  # fmt: skip
            if stream:
                with httpx.stream("POST", f"{server.base}/v1/completions", json=body,
                                  timeout=120) as resp:  # fmt: skip
                    out[tag] = returned(resp)
            else:
                resp = requests.post(f"{server.base}/v1/completions", json=body, timeout=120)
                out[tag] = returned(resp)

        threads = [threading.Thread(target=send, args=(t,)) for t in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert set(out) == {"a", "b"}
        got["a"] = (out["a"], [7 + 8 - 1], [(0, "post_block")], None)
        got["b"] = (out["b"], [5 + 8 - 1], [(3, "post_block"), (3, "mlp_out")], [1, 4, 9])
        rec.wait(lambda r: len({k for k, v in r.tags.items() if v["t"] in got}) == 8, 60)
        rec.wait_ended([k for k, v in rec.tags.items() if v["t"] in got])
    finally:
        rec.close()
    seen = set()
    for tag, (back, lens, keys, positions) in got.items():
        assert len(back) == len(lens), tag
        for i, fed_len in enumerate(lens):
            seen.add(_check_rows(server, rec, tag, back[i], fed_len, keys, positions))
    assert len(seen) == 8  # every sample's rows, none twice
    # Each choice's rows came in its chunks (as many pieces as the rows' arrival made),
    # joined above into every position once.
    assert pieces["stream"] >= 2 and pieces["chat_stream"] >= 1, pieces


def _sse(base: str, path: str, body: dict) -> list[dict]:
    """A streamed call's chunks, as JSON."""
    import httpx

    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()[:300]
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def _check_chunks(chunks: list[dict], prompt_of) -> dict[int, list[int]]:
    """Each chunk of a stream (``return_token_ids``) carries the rows of exactly the
    tokens it carries: the positions from where its choice's previous chunk ended to
    the one that fed its last token (the first chunk from 0: the prompt's too), with
    the token fed at each; ``complete`` on the choice's final chunk alone, none late.
    ``prompt_of(chunk, choice)``: the choice's prompt. Returns each choice's tokens."""
    gen: dict[int, list[int]] = {}
    owed: dict[int, int] = {}
    final: dict[int, bool] = {}
    for chunk in chunks:
        for ch in chunk.get("choices") or ():
            i = ch["index"]
            gen.setdefault(i, []).extend(ch.get("token_ids") or [])
            fed = prompt_of(chunk, i) + gen[i]
            limit = len(fed) - 1 if gen[i] else 0
            want = list(range(owed.get(i, 0), limit))
            acts = (ch.get("actbus") or {}).get("activations")
            if acts is None:  # a chat stream's first chunk (the role): no tokens
                assert not want, (i, want)
                continue
            assert acts["positions"] == want and "late" not in acts, (i, acts, want)
            assert acts["token_ids"] == [fed[p] for p in want], i
            assert all(r["shape"][0] == len(want) for r in acts["rows"]), i
            final[i] = ch.get("finish_reason") is not None
            assert acts.get("complete") is (True if final[i] else None), (i, acts)
            owed[i] = limit
    assert set(final) == set(gen) and all(final.values()), final
    return gen


def test_streamed_chunks_carry_their_own_tokens_rows(server):
    """Issue 49, 3: every chunk of a streamed ``"return": true`` call carries the rows of
    exactly its tokens (``_check_chunks``), joined every position once and bitwise the
    rows of the same call not streamed; so with several prompts and n=2, and in a chat
    stream, whose first chunks (the role) carry no tokens and no rows. A streamed call
    that did not ask carries no field, and the chunks' wait is counted."""
    from actbus.client import pieces, returned

    base, model = server.base, str(server.model)
    rng = random.Random(49)
    prompt = [rng.randrange(3, 400) for _ in range(13)]
    ask = {"max_tokens": 9, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
           **_ret("chunks", layers=[0, 3])}  # fmt: skip
    before = returns_stats(base)["streamed"]
    with urllib.request.urlopen(urllib.request.Request(
        f"{base}/v1/completions", json.dumps({"model": model, "prompt": prompt, **ask}).encode(),
        {"Content-Type": "application/json"}), timeout=120) as r:  # fmt: skip
        whole = json.loads(r.read())
    body = {"model": model, "prompt": prompt, "stream": True, **ask}
    chunks = _sse(base, "/v1/completions", body)
    gen = _check_chunks(chunks, lambda _, i: prompt)
    assert gen[0] == whole["choices"][0]["token_ids"]  # greedy: the same tokens
    once, streamed = returned(whole)[0], returned(chunks)[0]
    assert streamed.positions.tolist() == once.positions.tolist() == list(range(13 + 9 - 1))
    assert streamed.token_ids.tolist() == once.token_ids.tolist()
    assert set(streamed.tensors) == {(0, "post_block"), (0, "mlp_out"), (3, "post_block"),
                                     (3, "mlp_out")}  # fmt: skip
    for key, t in once.tensors.items():
        assert torch.equal(streamed[key].view(torch.int32), t.view(torch.int32)), key
    own = [(i, p.positions.tolist()) for i, p in pieces(chunks)]
    assert len(own) > 2 and own[0] == (0, list(range(13))), own[:2]  # the prompt's first
    sent = sum(1 for c in chunks for x in c["choices"] if "actbus" in x)
    # Several prompts, n=2, sampled: four choices, each chunk its own tokens' rows.
    prompts = [prompt[:7], prompt[4:]]
    body = {"model": model, "prompt": prompts, "n": 2, "stream": True,
            **ask, "temperature": 1.0, "max_tokens": 8}  # fmt: skip
    chunks = _sse(base, "/v1/completions", body)
    gen = _check_chunks(chunks, lambda _, i: prompts[i // 2])
    assert sorted(gen) == [0, 1, 2, 3] and all(len(g) == 8 for g in gen.values()), gen
    for i, got in returned(chunks).items():
        assert got.complete and got.positions.tolist() == list(range(len(prompts[i // 2]) + 7))
    sent += sum(1 for c in chunks for x in c["choices"] if "actbus" in x)
    # Chat, n=2: the prompt is the template's, in the first chunk.
    chat_prompt: list[int] = []

    def chat_prompt_of(chunk: dict, i: int) -> list[int]:
        if chunk.get("prompt_token_ids") and not chat_prompt:
            chat_prompt.extend(chunk["prompt_token_ids"])
        return chat_prompt

    msgs = [{"role": "user", "content": "the quick brown fox"}]
    body = {"model": model, "messages": msgs, "n": 2, "stream": True, **ask, "temperature": 1.0}
    chunks = _sse(base, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"].get("role") and "actbus" not in chunks[0]["choices"][0]
    gen = _check_chunks(chunks, chat_prompt_of)
    assert sorted(gen) == [0, 1] and chat_prompt
    sent += sum(1 for c in chunks for x in c["choices"] if "actbus" in x)
    # Not asked: no field, in no chunk.
    plain = _sse(base, "/v1/completions", {"model": model, "prompt": prompt, "stream": True,
                                           "max_tokens": 4})  # fmt: skip
    assert plain and not any("actbus" in x for c in plain for x in c["choices"])
    after = returns_stats(base)["streamed"]
    assert after["chunks"] - before["chunks"] == sent, (before, after)
    assert after["late_chunks"] == before["late_chunks"] and after["chunk_wait_s"] == CHUNK_WAIT_S


def test_a_client_gone_mid_read_ends_its_call(server):
    """Issue 49, 1: clients that stop reading part-way and hang up, one after the first
    rows of a long streamed ``"return"`` answer, one after the first bytes of a whole
    one too large for its socket's buffer: each call ends (its request leaves the
    engine, its reservation is let go) rather than hang, ``/health`` answers, and the
    next streamed call comes back whole."""
    base, model = server.base, str(server.model)
    wait_for(lambda: returns_stats(base)["held_bytes"] == 0, 60, "earlier reservations to go")
    streamed = {"model": model, "prompt": list(range(3, 13)), "max_tokens": 480,
                "ignore_eos": True, "stream": True,
                **_ret("gone", layers=[3], hooks=["post_block"])}  # fmt: skip
    s = post_unread(base, "/v1/completions", streamed)
    try:
        s.settimeout(120)
        got = b""
        while b'"activations"' not in got:  # the prompt's rows, in the first chunk
            more = s.recv(1 << 16)
            assert more, got[-300:]
            got += more
    finally:
        s.close()
    whole = {"model": model, "prompt": list(range(3, 13)), "max_tokens": 200,
             "ignore_eos": True, **_ret("gone_whole")}  # fmt: skip
    w = post_unread(base, "/v1/completions", whole)  # 0.57 MiB of base64
    try:
        assert status_of(w, 120) == 200
        assert w.recv(4096)
    finally:
        w.close()
    wait_for(lambda: metric(base, "vllm:num_requests_running") == 0, 60, "the requests to end")
    wait_for(lambda: returns_stats(base)["held_bytes"] == 0, 60, "the reservations to go")
    _healthy(server)
    ask = {"max_tokens": 6, "ignore_eos": True, "return_token_ids": True, **_ret("after")}
    prompt = list(range(3, 13))
    body = {"model": model, "prompt": prompt, "stream": True, **ask}
    _check_chunks(_sse(base, "/v1/completions", body), lambda _, i: prompt)


def test_returned_rows_limits_and_fetch(server):
    """The bounds of rows returned over HTTP: a request that may get more than
    ``http_return_max_request_mb`` is a 400 naming it; rows kept for fetching count
    against ``http_return_max_server_mb`` until fetched (once), and a request beyond it
    is a 400 naming it; fetched, they are the inline rows' bytes."""
    import openai
    from safetensors.torch import load

    from actbus.client import fetch, returned

    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=120, max_retries=0)
    model = str(server.model)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt=list(range(3, 13)), max_tokens=400,
                             extra_body=_ret("big"))  # fmt: skip
    assert e.value.status_code == 400
    hidden = json.loads((server.model / "config.json").read_text())["hidden_size"]
    assert "http_return_max_request_mb (0.6 MiB)" in str(e.value), str(e.value)
    assert f"1 sample(s) x 409 positions x 4 taps x {4 * hidden} bytes a row" in str(e.value)
    prompt = list(range(3, 13))
    kept = []
    for i in range(2):  # about 0.45 MiB each: two fit in the server's 1 MiB (two clients')
        r = _client_at(server, f"127.0.0.{2 + i}").completions.create(
            model=model, prompt=prompt, max_tokens=220, temperature=0,
            extra_body={"ignore_eos": True, **_ret(f"fetch{i}", **{"return": "fetch"})},
        )  # fmt: skip
        (ch,) = r.choices
        info = _extra(ch)["activations"]
        assert set(info) == {"fetch", "bytes", "expires_in_s", "rows", "complete"}, info
        assert info["rows"] == 229 and info["complete"] is True
        kept.append(info)
    third = {"ignore_eos": True, **_ret("third", **{"return": "fetch"})}
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt=prompt, max_tokens=220, extra_body=third)
    assert "http_return_max_server_mb (1 MiB)" in str(e.value), str(e.value)
    got = fetch(server.base, kept[0]["fetch"])
    with pytest.raises(urllib.error.HTTPError) as gone:  # once
        fetch(server.base, kept[0]["fetch"])
    assert gone.value.code == 404
    with urllib.request.urlopen(server.base + kept[1]["fetch"], timeout=30) as resp:
        blob = resp.read()
    assert len(blob) == kept[1]["bytes"] and set(load(blob)) >= {"L0.post_block", "positions"}
    r = c.completions.create(model=model, prompt=prompt, max_tokens=220, temperature=0,
                             extra_body={"ignore_eos": True, **_ret("inline")})  # fmt: skip
    inline = returned(r)[0]
    assert got.positions.tolist() == inline.positions.tolist() == list(range(229))
    for key, t in inline.tensors.items():
        assert torch.equal(got[key], t), key


def _client_at(server, source: str):
    """An openai client whose connections come from ``source`` (a loopback address: a
    client of its own, to the server)."""
    import httpx
    import openai

    transport = httpx.HTTPTransport(local_address=source)
    http = httpx.Client(transport=transport, timeout=120)
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, http_client=http)


def test_one_client_cannot_starve_the_others_of_the_fetch_store(server):
    """Issue 45, 7: rows kept for fetching are shared out by client. One client that
    keeps its share (``http_return_fetch_client_mb``) unfetched is refused more, with
    a 400 naming the key, and counted; another client's rows are still kept (before,
    the first client's two took the whole server and every other caller got a 400)."""
    from actbus.client import fetch

    model = str(server.model)
    ask = {"ignore_eos": True, **_ret("share", **{"return": "fetch"})}
    greedy, other = _client_at(server, "127.0.0.5"), _client_at(server, "127.0.0.6")
    r = greedy.completions.create(model=model, prompt=list(range(3, 13)), max_tokens=220,
                                  extra_body=ask)  # fmt: skip
    kept = [_extra(r.choices[0])["activations"]["fetch"]]
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        # 0.08 MiB more: within the server's room, past this client's share
        greedy.completions.create(model=model, prompt=[5, 6, 7], max_tokens=40, extra_body=ask)
    assert "this client (127.0.0.5)" in str(e.value), str(e.value)
    assert "http_return_fetch_client_mb (0.5 MiB)" in str(e.value), str(e.value)
    r = other.completions.create(model=model, prompt=list(range(3, 13)), max_tokens=220,
                                 extra_body=ask)  # fmt: skip
    kept.append(_extra(r.choices[0])["activations"]["fetch"])
    stats = returns_stats(server.base)
    assert stats["refused"]["client"] == 1, stats
    assert set(stats["stored_by_client"]) == {"127.0.0.5", "127.0.0.6"}, stats
    for path in kept:
        assert fetch(server.base, path).complete is True
    assert returns_stats(server.base)["held_bytes"] == 0


def test_one_http_call_is_held_to_the_request_cap_over_its_prompts(server):
    """Issue 45, 4: ``http_return_max_request_mb`` bounds one HTTP call over all its
    prompts and samples (it was counted per prompt: a call of many prompts got back
    many times the cap). Three prompts that each fit alone are a 400 naming the call's
    own total and the key; two that fit together come back whole."""
    import openai

    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=120, max_retries=0)
    model = str(server.model)
    prompt = list(range(3, 13))  # 109 positions x 4 taps x 512 bytes: 0.28 MiB as base64
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt=[prompt] * 3, max_tokens=100,
                             extra_body={"ignore_eos": True, **_ret("call3")})  # fmt: skip
    text = str(e.value)
    assert "this HTTP call's 3 prompts may get up to 0.85 MiB of rows back in all" in text, text
    assert "http_return_max_request_mb (0.6 MiB)" in text and "prompt 2: 0.28 MiB" in text, text
    r = c.completions.create(model=model, prompt=[prompt] * 2, max_tokens=100, temperature=0,
                             extra_body={"ignore_eos": True, **_ret("call2")})  # fmt: skip
    from actbus.client import returned

    back = returned(r)
    assert sorted(back) == [0, 1]
    for got in back.values():
        assert got.complete is True and got.positions.tolist() == list(range(109))
    wait_for(
        lambda: returns_stats(server.base)["held_bytes"] == 0, 30, "the call's reservations to go"
    )


def test_a_client_gone_while_queued_never_holds_up_the_server(server):
    """Issue 45, 1: a ``"return": true`` request still queued whose client hangs up.
    Its final output (the abort's) used to wait, on the server's event loop, for rows
    of a prompt never computed: ``/health`` took seconds (5, with nothing else
    returning rows), and the engine heard of the abort only after. Now ``/health``
    answers at once all the while, and the neighbour is bitwise the same."""
    import http.client
    from urllib.parse import urlparse

    before = _neighbour(server)
    plain = {"model": str(server.model), "prompt": [5, 6, 7], "max_tokens": 500,
             "ignore_eos": True, "temperature": 0}  # fmt: skip
    done: list[int] = []
    blockers = [
        threading.Thread(target=lambda: done.append(_send(server, Case(
            "blocker", "POST", "/v1/completions", json.dumps(plain).encode()))[0]))
        for _ in range(8)  # the server's --max-num-seqs: the next request queues
    ]  # fmt: skip
    for t in blockers:
        t.start()
    try:
        wait_for(lambda: metric(server.base, "vllm:num_requests_running") >= 8, 60, "8 running")
        u = urlparse(server.base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        body = {"model": str(server.model), "prompt": list(range(3, 43)), "max_tokens": 4,
                **_ret("queued", positions="all")}  # fmt: skip
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        waiting = "vllm:num_requests_waiting"
        wait_for(lambda: metric(server.base, waiting) >= 1, 30, "the request to queue")
        conn.close()  # gone, while queued
        took = []
        deadline = time.monotonic() + 3.0  # the old stall: 5 s (STALL_S)
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            _healthy(server)
            took.append(time.monotonic() - t0)
    finally:
        for t in blockers:
            t.join(timeout=240)
    took.sort()
    assert took[-1] < 1.0 and took[len(took) // 2] < 0.1, took[-5:]
    assert done == [200] * 8
    assert _neighbour(server) == before


def test_scale_out_generate_is_an_http_caller(server):
    """``/inference/v1/generate`` (``--enable-scale-out``) takes sampling parameters, its
    ``extra_args`` a mapping, from the peer: an HTTP caller's, bounded like any other."""
    sp = {"max_tokens": 400, "extra_args": {"actbus": {"return": True}}}
    body = {"model": str(server.model), "token_ids": list(range(3, 13)), "sampling_params": sp}
    case = Case("scale-out", "POST", "/inference/v1/generate", json.dumps(body).encode())
    status, text = _send(server, case)
    assert status == 400 and "http_return_max_request_mb (0.6 MiB)" in text, (status, text[:300])
    _healthy(server)


def test_steering_over_http_matches_hf(server):
    """A vector sent in vllm_xargs steers that request alone; bad steering is a 400."""
    import openai
    import torch

    from tests.support.steer_oracle import HFSteer, hf_steered_greedy

    base, model_path = server.base, server.model
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
    prompt = [random.Random(3).randrange(3, 400) for _ in range(19)]
    stream = hf_activations(model_path, prompt, [1], ["post_block"])[(1, "post_block")]
    norm = float(stream.norm(dim=-1).mean())
    v = torch.randn(stream.shape[1], generator=torch.Generator().manual_seed(1))
    v = 2 * norm * v / v.norm()
    steer = [{"vector": v.tolist(), "layers": 2, "scale": 1.0}]
    got = {}
    for name, extra in (("steered", _selection(steer=steer)), ("plain", {})):
        r = c.completions.create(
            model=str(model_path), prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        )  # fmt: skip
        got[name] = list(r.choices[0].token_ids)
    # The same vector registered by name over HTTP, then steered with by name.
    assert _call(base, "PUT", "vectors/push", {"values": v.tolist()})[1]["width"] == len(v)
    status, listed = _call(base, "GET", "vectors")
    assert status == 200 and [x["name"] for x in listed["vectors"]] == ["push"]
    by_name = _selection(steer=[{"vector": "push", "layers": 2}])
    r = c.completions.create(
        model=str(model_path), prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **by_name},
    )  # fmt: skip
    got["by_name"] = list(r.choices[0].token_ids)
    assert _call(base, "DELETE", "vectors/push")[0] == 200
    assert _call(base, "DELETE", "vectors/push")[0] == 404
    status, err = _call(base, "PUT", "vectors/bad", {"values": [1.0, 2.0]})
    assert status == 400 and "has 2 values" in err["error"], err
    status, err = _call(base, "PUT", "vectors/bad", {"sae": "/nonexistent"})
    assert status == 400 and err["error"].startswith("body.feature"), err
    want, _ = hf_steered_greedy(model_path, prompt, 6, [HFSteer(2, "post_block", v)], [])
    plain, _ = hf_steered_greedy(model_path, prompt, 6, [], [])
    assert got == {"steered": want, "plain": plain, "by_name": want} and want != plain
    for raw, needle in (
        ({"steer": [{"vector": "push", "layers": 1}]}, "no steering vector named 'push'"),
        (
            {"steer": [{"vector": [1.0], "layers": 3}]},
            "steer[0].layers[0]: layer 3 cannot be steered",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(
                model=str(model_path), prompt=[5, 6, 7], max_tokens=4,
                extra_body={"vllm_xargs": {"actbus": json.dumps(raw)}},
            )  # fmt: skip
        assert e.value.status_code == 400 and needle in str(e.value), str(e.value)


MONITORED = {"monitor": ["drift", "gate"], "monitor_return": True}


def _series(pieces: list[dict]) -> tuple[list[int], list[int], dict, dict, list[bool]]:
    """``choices[i].actbus.monitor`` pieces (one, or a stream's) joined: positions,
    token ids, values and versions per (monitor, layer), and each piece's ``complete``."""
    pos, toks, vals, vers, done = [], [], {}, {}, []
    for m in pieces:
        pos += m["positions"]
        toks += m["token_ids"]
        for name, entries in m["scores"].items():
            for e in entries:
                vals.setdefault((name, e["layer"]), []).extend(e["values"])
                vers.setdefault((name, e["layer"]), []).extend(e["version"])
        done.append(m.get("complete"))
    return pos, toks, vals, vers, done


def _check_scores(server, log, rid: str, sample: int, pieces: list[dict], fed_len: int):
    """The JSON scores of one choice: every fed position once, the bus values bitwise
    (as float32), version 1, HF's values; ``complete`` on the last piece only."""
    pos, toks, vals, vers, done = _series(pieces)
    assert pos == list(range(fed_len)), (rid, sample, pos[:5], len(pos), fed_len)
    assert done[-1] is True and not any(done[:-1]), done
    mons = server_monitors(server.model)
    assert set(vals) == {("drift", 0), ("drift", 3), ("gate", 2)}
    ref = hf_activations(server.model, toks, [0, 2, 3], ["post_block", "mlp_out"])
    for (name, layer), v in vals.items():
        rows = sorted(log.rows[(rid, sample, name, layer)], key=lambda r: r[0])
        assert [r[1] for r in rows] == toks, (rid, name, layer)
        got = as_f32(v)
        assert got.shape == (fed_len, 1)
        assert np.array_equal(got, np.stack([r[2] for r in rows])), (rid, sample, name, layer)
        assert vers[(name, layer)] == [1] * fed_len
        hook = mons[name].get("hook", "post_block")
        ref_scores = raw_expected(mons[name], ref[(layer, hook)])
        assert max_rel(torch.from_numpy(got), ref_scores) <= 1e-4, (name, layer)


def _extra(choice) -> dict | None:
    return (choice.model_extra or {}).get("actbus")


def test_monitor_scores_come_back_in_http_responses(server):
    """``"monitor_return": true`` over HTTP: completions and chat completions, plain and
    streamed, n=2: each choice carries ``actbus.monitor``, exactly what a bus subscriber
    got; requests that did not ask carry nothing."""
    import openai

    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=120, max_retries=0)
    model = str(server.model)
    rng = random.Random(8)
    prompt = [rng.randrange(3, 400) for _ in range(37)]
    xargs = {"vllm_xargs": {"actbus": json.dumps(MONITORED)}}
    log = ScoreLog(server.address)
    got: dict[str, tuple] = {}
    try:
        r = c.completions.create(
            model=model, prompt=prompt, max_tokens=7, temperature=1.0, n=2,
            extra_body={"ignore_eos": True, "return_token_ids": True, **xargs},
        )  # fmt: skip
        got["full"] = (
            r.id,
            [(ch.index, [_extra(ch)["monitor"]], len(ch.token_ids)) for ch in r.choices],
        )
        pieces: dict[int, list] = {}
        ntok: dict[int, int] = {}
        sid = None
        for chunk in c.completions.create(
            model=model, prompt=prompt[:23], max_tokens=9, temperature=1.0, n=2, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True, **xargs},
        ):  # fmt: skip
            sid = chunk.id
            for ch in chunk.choices:
                if _extra(ch):
                    pieces.setdefault(ch.index, []).append(_extra(ch)["monitor"])
                ntok[ch.index] = ntok.get(ch.index, 0) + len(ch.token_ids or [])
        got["stream"] = (sid, [(i, p, ntok[i]) for i, p in sorted(pieces.items())])
        chat = {"ignore_eos": True, **xargs}
        msgs = [{"role": "user", "content": "the quick brown fox"}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=5, extra_body=chat)
        (ch,) = r.choices
        got["chat"] = (r.id, [(0, [_extra(ch)["monitor"]], r.usage.completion_tokens)])
        chat_prompt = r.usage.prompt_tokens
        cpieces, cid = [], None
        for chunk in c.chat.completions.create(
            model=model, messages=msgs, max_tokens=6, stream=True, extra_body=chat
        ):
            cid = chunk.id
            cpieces += [_extra(ch)["monitor"] for ch in chunk.choices if _extra(ch)]
        got["chat_stream"] = (cid, [(0, cpieces, 6)])
        # Monitored without asking, and not monitored: no field, byte for byte vLLM's.
        quiet = {"vllm_xargs": {"actbus": json.dumps({"monitor": ["drift"]})}}
        for extra in (quiet, {}):
            r = c.completions.create(
                model=model, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True, **extra}
            )
            assert _extra(r.choices[0]) is None and '"actbus":' not in r.model_dump_json()
        log.wait_ended({k[:2] for k in log.rows})
    finally:
        log.close()
    checked = 0
    for what, (resp_id, choices) in got.items():
        (rid,) = {k[0] for k in log.rows if k[0].startswith(resp_id)}
        prompt_len = {"full": 37, "stream": 23}.get(what, chat_prompt)
        for index, pieces, ntokens in choices:
            fed_len = prompt_len + ntokens - 1
            _check_scores(server, log, rid, index, pieces, fed_len)
            checked += 1
    assert checked == 6
    # A streamed piece carries the scores of what its chunk added: several pieces.
    assert all(len(p) > 2 for _, p, _ in got["stream"][1]) and len(got["chat_stream"][1][0][1]) > 2


def test_a_client_gone_mid_stream_leaves_the_server_serving(server):
    """A streaming client that hangs up after the first chunk: the server goes on, and
    the next request's scores come back whole."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(server.base)
    body = {
        "model": str(server.model), "prompt": [5, 6, 7, 8, 9], "max_tokens": 300,
        "ignore_eos": True, "stream": True, "vllm_xargs": {"actbus": json.dumps(MONITORED)},
    }  # fmt: skip
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.read(6)  # the start of the first chunk
    assert resp.status == 200 and first == b"data: ", first
    conn.close()  # gone
    import openai

    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=120, max_retries=0)
    r = c.completions.create(
        model=str(server.model), prompt=[5, 6, 7], max_tokens=4,
        extra_body={"ignore_eos": True, "vllm_xargs": {"actbus": json.dumps(MONITORED)}},
    )  # fmt: skip
    m = _extra(r.choices[0])["monitor"]
    assert m["complete"] is True and m["positions"] == list(range(3 + 4 - 1))
    with Subscriber(server.address, Subscription(layers=(), name="check")) as sub:
        sub.wait_welcome(30)
        subscribers = stats_of(sub, 10)["subscribers"]
    assert "actbus-scores" in subscribers, subscribers


def _scores_of(c, server, prompt: list[int], request_id: str | None, out: dict, key) -> None:
    """A greedy completion with its scores back: (generated ids, its ``actbus.monitor``)."""
    r = c.completions.create(
        model=str(server.model), prompt=prompt, max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "vllm_xargs": {"actbus": json.dumps(MONITORED)}},
        extra_headers={"X-Request-Id": request_id} if request_id else None,
    )  # fmt: skip
    out[key] = (list(r.choices[0].token_ids), _extra(r.choices[0])["monitor"])


def test_duplicate_request_ids_never_mix_returned_scores(server):
    """Two concurrent requests with one ``X-Request-Id`` and ``monitor_return``: each
    gets exactly its own scores, as when it runs alone (they were filed under the
    caller's id, and about a third of one's positions came from the other). Bus
    subscribers still see both under the caller's id."""
    import openai

    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=120, max_retries=0)
    rng = random.Random(33)
    prompts = {k: [rng.randrange(3, 400) for _ in range(60 + 7 * k)] for k in (0, 1)}
    alone: dict = {}
    for k, p in prompts.items():
        _scores_of(c, server, p, None, alone, k)
    for trial in range(2):
        together: dict = {}
        threads = [
            threading.Thread(target=_scores_of, args=(c, server, p, "dup", together, k))
            for k, p in prompts.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert set(together) == {0, 1}, f"trial {trial}: a request failed"
        for k, p in prompts.items():
            gen, m = together[k]
            assert gen == alone[k][0], (trial, k)
            fed = (p + gen)[:-1]
            assert m["complete"] is True and m["token_ids"] == fed, (trial, k)
            assert m["positions"] == list(range(len(fed))), (trial, k)
            for name, entries in m["scores"].items():
                want = {e["layer"]: e["values"] for e in alone[k][1]["scores"][name]}
                for e in entries:
                    got, ref = as_f32(e["values"]), as_f32(want[e["layer"]])
                    assert max_rel(torch.from_numpy(got), torch.from_numpy(ref)) <= 1e-4


def _send(server, case) -> tuple[int, str]:
    """One raw HTTP call: (status, body text)."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(server.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    headers = {"Content-Type": "application/json", **dict(case.headers)}
    if case.key is not None:
        headers["Authorization"] = f"Bearer {case.key}"
    try:
        if case.chunked:
            chunks = (case.body[i : i + (1 << 20)] for i in range(0, len(case.body), 1 << 20))
            conn.request(case.method, case.path, chunks, headers, encode_chunked=True)
        else:
            conn.request(case.method, case.path, case.body, headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    except (ConnectionError, http.client.HTTPException) as e:  # the server cut it off
        return 0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _neighbour(server) -> str:
    """A fixed greedy request with logprobs: its choice as JSON, to compare bitwise."""
    body = {
        "model": str(server.model), "prompt": [11, 12, 13, 14, 15], "max_tokens": 8,
        "temperature": 0, "logprobs": 3, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    status, text = _send(
        server, Case("neighbour", "POST", "/v1/completions", json.dumps(body).encode())
    )
    assert status == 200, text
    return json.dumps(json.loads(text)["choices"], sort_keys=True)


def _healthy(server) -> None:
    with urllib.request.urlopen(f"{server.base}/health", timeout=30) as r:
        assert r.status == 200
    assert server.proc.poll() is None


def test_hostile_http_calls_are_refused_and_leave_the_server_serving(server):
    """The HTTP fuzz (issue 33): a fixed corpus of hostile completions, chat completions
    and steering calls (``tests/capture/hostile_http.py``). Every one is refused with a
    4xx, never a 5xx or a dropped connection; ``/health`` answers after every one; a
    neighbouring greedy request (logprobs and all) is bitwise the same before, during,
    after every ten and after all; and nothing was registered or set by them."""
    hidden = json.loads((server.model / "config.json").read_text())["hidden_size"]
    cases = corpus(str(server.model), hidden, server.vectors, ADMIN)
    assert len(cases) > 80
    before = _neighbour(server)
    during: list[str] = []
    side = threading.Thread(target=lambda: during.extend(_neighbour(server) for _ in range(3)))
    side.start()
    bad, changed = [], []
    for i, case in enumerate(cases):
        status, text = _send(server, case)
        if not 400 <= status < 500:
            bad.append((case.name, status, text[:300]))
        elif "Traceback" in text or len(text) > 4000:
            bad.append((case.name, status, f"a reply of {len(text)} characters: {text[:300]}"))
        _healthy(server)
        if i % 10 == 9 and _neighbour(server) != before:
            changed.append(case.name)
    side.join(timeout=240)
    assert not bad, "\n".join(map(str, bad))
    assert not changed, f"the neighbour changed after: {changed}"
    assert during == [before] * 3
    assert _neighbour(server) == before
    assert _call(server.base, "GET", "vectors") == (200, {"vectors": []})
    assert _call(server.base, "GET", "steer/global") == (200, {"entries": []})
    # The refusals of paths outside the vector directory say the same, exist or not.
    outside = [c for c in cases if c.name.removeprefix("steering: ") in OUTSIDE]
    assert len(outside) == len(OUTSIDE)
    texts = {json.loads(_send(server, c)[1])["error"] for c in outside}
    assert texts == {
        "vectors.x: not under the server's vector directories; paths must lie in one of "
        "actbus.steer.vector_dirs (links followed)"
    }, texts
    # What the directory holds can be registered, by the admin key's holder only.
    good = {"file": str(server.vectors / "good.safetensors")}
    assert _call(server.base, "PUT", "vectors/good", good, key="x")[0] == 401
    status, out = _call(server.base, "PUT", "vectors/good", good)
    assert status == 200 and out["width"] == hidden, out
    assert _call(server.base, "DELETE", "vectors/good")[0] == 200


@pytest.mark.parametrize("case", range(7))
def test_hostile_numbers_are_refused(server, case):
    """Numbers past the type they become, over HTTP (issue 33): a 400 naming the field,
    and the server serves on with its neighbour unchanged. The first case also goes to
    ``PUT /v1/actbus/steer/global``, which took position 2**63 with a 200 (every later
    request would have crashed the engine)."""
    hidden = json.loads((server.model / "config.json").read_text())["hidden_size"]
    name, actbus, field = number_cases(hidden)[case]
    before = _neighbour(server)
    text = actbus if isinstance(actbus, str) else json.dumps(actbus, separators=(",", ":"))
    body = json.dumps({
        "model": str(server.model), "prompt": [5, 6, 7], "max_tokens": 2,
        "vllm_xargs": {"actbus": text},
    }).encode()  # fmt: skip
    status, text = _send(server, Case(name, "POST", "/v1/completions", body))
    assert status == 400 and field in text, (name, status, text[:300])
    if case == 0:
        entry = {"vector": [1.0] * hidden, "layers": 1, "positions": [1 << 63]}
        status, err = _call(server.base, "PUT", "steer/global", {"entries": [entry]})
        assert status == 400 and "actbus.steer.global[0].positions[0]" in err["error"], err
        assert _call(server.base, "GET", "steer/global") == (200, {"entries": []})
    _healthy(server)
    assert _neighbour(server) == before


def test_ctrl_c_of_the_server_ends_the_stream(server):
    """Ctrl-C (SIGINT to ``actbus serve``): vLLM kills its engine without the publisher's
    END, so actbus serve sends it once the server exited. An ``--exit-on-end`` consumer
    exits 0 and a subscriber sees END (both waited forever). Runs last: it stops the
    module's server. The server's log says what it captures and publishes where."""
    consumer = subprocess.Popen(
        consumer_command("null", server.address, "--exit-on-end"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    sub = Subscriber(server.address, Subscription(layers=(), name="watcher"))
    try:
        sub.wait_welcome(30)
        deadline = time.monotonic() + 60
        with Subscriber(server.address, Subscription(layers=(), name="check")) as check:
            check.wait_welcome(30)
            while "null" not in stats_of(check, 10)["subscribers"]:
                assert time.monotonic() < deadline and consumer.poll() is None, "no consumer"
                time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        ended = None
        deadline = time.monotonic() + 90
        while ended is None and time.monotonic() < deadline:
            out = sub.recv(timeout=0.5)
            if isinstance(out, Event) and out.kind == "end":
                ended = out
        assert ended is not None, "no END within 90 s of Ctrl-C"
        assert consumer.wait(timeout=60) == 0, consumer.stdout.read()[-3000:]
        assert server.proc.wait(timeout=60) == 0
    finally:
        sub.close()
        if consumer.poll() is None:
            consumer.kill()
    log = server.log.read_text()
    assert "actbus serve: the engine will capture layers [0, 3], hooks ['post_block', " in log
    assert f"and publish on {server.address}" in log
    assert "actbus: capturing layers [0, 3] hooks ['post_block', 'mlp_out']" in log
    assert "actbus serve: the server exited (0); told" in log
