"""``actbus serve``: the OpenAI-compatible server with capture, driven by the openai client.

Started as users start it, in its own process; the engine taps two layers and
captures only requests that ask (``--requests selected``), over HTTP through
``vllm_xargs={"actbus": "<json>"}``.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.collector import Collector
from tests.support.oracle import hf_activations, max_rel_error

pytestmark = pytest.mark.engine
LAYERS, HOOKS = [0, 3], ["post_block", "mlp_out"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    address, port = f"ipc://{tmp}/bus.sock", _free_port()
    log = open(tmp / "server.log", "w")  # noqa: SIM115 (closed below)
    cmd = [
        sys.executable, "-m", "actbus.cli", "serve", str(tiny_models["llama"]),
        "--layers", ",".join(map(str, LAYERS)), "--hooks", ",".join(HOOKS),
        "--requests", "selected", "--publish", address,
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.3", "--num-gpu-blocks-override", "64",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(tmp / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not healthy within 300 s")
            time.sleep(1)
        yield base, address, Path(tiny_models["llama"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _selection(**kw) -> dict:
    return {"vllm_xargs": {"actbus": json.dumps(kw)}}


def test_two_concurrent_clients_get_their_rows(server):
    import openai

    base, address, model_path = server
    col = Collector(address)
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

    base, address, model_path = server
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
    col = Collector(address)
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
