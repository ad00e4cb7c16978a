"""The router stream of a real MoE engine, end to end: the fs sink stores it, ``actbus
stats`` and the web dashboard show the expert load per layer (the page read in headless
Chromium), each equal to what the engine published.

``actbus serve`` on a tiny Qwen3-MoE model (Dynamo only) taps the router of layers 0
and 3; three requests go to its OpenAI server. A lossless subscriber records every router row the
engine published; the three consumers run as the user runs them, each its own
process: ``actbus run fs-sink --hooks router --reduce int8`` (router rows are stored
as published whatever the reduction), ``actbus stats --json --experts-s`` (it listens
until Ctrl-C) and ``actbus dashboard``. The sink and stats are stopped as a user
stops them (SIGTERM, Ctrl-C), once they hold every row.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import datasets
import numpy as np
import pytest

from actbus.bus import Subscriber
from actbus.bus.protocol import Subscription
from actbus.bus.statsview import EXPERTS_NAME, request, stats_subscription
from actbus.tiny_models import build_tiny_model
from consumers.fs import ActivationRun
from tests.support.dashboard_procs import Browser, DashboardProc, chromium_missing, page_experts
from tests.support.procs import ROOT, free_port, start_sink, stop, wait_for, wait_healthy
from tests.support.recorder import RowRecorder

pytestmark = pytest.mark.engine

LAYERS = [0, 3]
LENGTHS = [9, 20, 33]
MAX_TOKENS = 6
ARTIFACTS = ROOT / "tests" / "artifacts"
STATS = ("--timeout", "120", "--experts-s", "600")
"""``actbus stats`` waits for the engine to start, then listens until it ends."""


def _serve(path, address: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``actbus serve`` on the tiny MoE model, tapping the router: the server and its
    URL, once healthy. Eager: what is under test is the router stream, not the compiled
    graph (tests/capture/test_moe.py taps the router in it)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "actbus.cli", "serve", str(path),
        "--layers", ",".join(map(str, LAYERS)), "--hooks", "post_block,router",
        "--publish", address, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
        "--num-gpu-blocks-override", "32", "--no-enable-prefix-caching", "--enforce-eager",
        "--actbus-config", json.dumps({"heartbeat_s": 0.25}),
    ]  # fmt: skip
    with open(log, "wb") as out:  # the server keeps its own descriptor of it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log, 300)
    return proc, url


def _complete(url: str, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def _subscribers(address: str) -> dict[str, dict]:
    """The publisher's subscribers by name, from its own counters."""
    with Subscriber(address, stats_subscription(), keepalive=False) as sub:
        sub.wait_welcome(30)
        return {s.get("name") or k: s for k, s in request(sub, 10)["subscribers"].items()}


def _rows(out) -> dict[str, int] | None:
    """The rows the sink's manifest lists per stream (None before its first write)."""
    try:
        return json.loads((out / "manifest.json").read_text()).get("rows")
    except (OSError, ValueError):
        return None


def test_the_router_stream_is_sunk_and_its_expert_load_shown(tmp_path):
    path = build_tiny_model("qwen3_moe")
    address = f"ipc://{tmp_path}/bus.sock"
    out = tmp_path / "run"
    why_no_browser = chromium_missing()
    # The consumers start beside the engine: they wait for its publisher.
    sink = start_sink(address, out, "--hooks", "router", "--reduce", "int8")
    stats_log = open(tmp_path / "stats.log", "wb")  # noqa: SIM115 (closed below)
    stats = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "stats", "--connect", address, "--json", *STATS],
        stdout=subprocess.PIPE,
        stderr=stats_log,
        cwd=ROOT,
    )
    dash = DashboardProc(address, tmp_path / "dash.log", "--interval", "0.2")
    server = browser = rec = None
    try:
        server, url = _serve(path, address, tmp_path / "server.log")
        rec = RowRecorder(address, Subscription(window=1024, hooks=("router",)))
        router = rec.sub.welcome["router"]
        num_experts, top_k = router["num_experts"], router["top_k"]
        assert top_k < num_experts
        names = {"fs-sink", "dashboard", "dashboard-scores", EXPERTS_NAME}
        wait_for(lambda: names <= set(_subscribers(address)), 120, f"subscribers {names}", 0.5)
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
        for p in prompts:
            _complete(url, str(path), p)
        wait_for(lambda: len(rec.ended) == len(prompts), 60, "every request's end")
        rids = sorted(rid for rid, _ in rec.ended)
        # What the engine published: every router row, by request and layer.
        published = {
            (rid, layer): rec.get(rid, layer, "router") for rid in rids for layer in LAYERS
        }
        want = {}
        for layer in LAYERS:
            rows = np.concatenate([published[rid, layer][2].numpy() for rid in rids])
            ids = rows[:, :top_k].astype(np.int64).ravel()
            assert len(rows) == sum(LENGTHS) + len(LENGTHS) * (MAX_TOKENS - 1)
            want[str(layer)] = {
                "tokens": len(rows),
                "counts": np.bincount(ids, minlength=num_experts).tolist(),
                "weights": np.bincount(
                    ids, weights=rows[:, top_k:].astype(np.float64).ravel(), minlength=num_experts
                ),
            }

        def same_load(layers: dict, what: str) -> None:
            assert list(layers) == [str(x) for x in LAYERS], what
            for layer, w in want.items():
                got = layers[layer]
                assert got["tokens"] == w["tokens"] and got["counts"] == w["counts"], what
                np.testing.assert_allclose(got["weights"], w["weights"], rtol=1e-9, err_msg=what)

        # The dashboard: its snapshot, then the page in Chromium.
        def dashboard_has_all():
            e = dash.snapshot().get("experts") or {}
            layers = e.get("layers") or {}
            done = all(layers.get(k, {}).get("tokens") == w["tokens"] for k, w in want.items())
            return e if done else None

        snap = wait_for(dashboard_has_all, 60, "every router row on the dashboard")
        assert snap["num_experts"] == num_experts and snap["top_k"] == top_k
        assert snap["subscribed"] and snap["missed"] == 0 and snap["bad_rows"] == 0
        same_load(snap["layers"], "dashboard snapshot")
        assert not dash.snapshot()["monitors"]["subscribed"]  # the engine has no monitors
        if why_no_browser is None:
            browser = Browser(dash.url, tmp_path / "chromium")
            page = wait_for(
                lambda: (
                    (p := page_experts(browser))["layers"]
                    and all(r["tokens"] == want[r["layer"]]["tokens"] for r in p["layers"])
                    and p
                ),
                30,
                "the expert-load panel",
            )
            assert not page["hidden"] and f"{num_experts} experts, top {top_k}" in page["status"]
            same_load({r["layer"]: r for r in page["layers"]}, "page")
            assert all(r["bars"] == 2 * num_experts for r in page["layers"])
            ARTIFACTS.mkdir(exist_ok=True)
            browser.screenshot(ARTIFACTS / "dashboard_experts.png")  # to look at, not checked

        # actbus stats: once it has read every router message, Ctrl-C prints its count.
        def stats_read_all():
            sub = _subscribers(address)[EXPERTS_NAME]
            return sub["sent"] >= rec.messages and not sub["inflight"]

        wait_for(stats_read_all, 60, "actbus stats to read every router message", 0.25)
        stats.send_signal(signal.SIGINT)
        # The sink: once its manifest lists every row, SIGTERM ends it (as a user stops it).
        stored = {f"L{x}.router": want[str(x)]["tokens"] for x in LAYERS}
        wait_for(lambda: _rows(out) == stored, 60, "every router row committed by the sink", 0.25)
    finally:
        if browser is not None:
            browser.close()
        server_rc = stop(server) if server is not None else None
        dash_rc = dash.stop()
    try:
        stats_out, _ = stats.communicate(timeout=60)
    finally:
        stop(stats)
        sink_rc = stop(sink)
        stats_log.close()
        if rec is not None:
            rec.close()
    assert server_rc == 0, (tmp_path / "server.log").read_text()[-3000:]
    assert dash_rc == 0, (tmp_path / "dash.log").read_text()
    # actbus stats: the publisher's counters and, listened until the end, the load.
    assert stats.returncode == 0, (tmp_path / "stats.log").read_text()
    printed = json.loads(stats_out)
    assert printed["experts"]["missed"] == 0 and printed["experts"]["bad_rows"] == 0
    same_load(printed["experts"]["layers"], "actbus stats")
    assert printed["experts"]["num_experts"] == num_experts and "published" in printed
    # The fs sink: each request's router rows as published, under --reduce int8.
    assert sink_rc == 0, (tmp_path / "run.log").read_text()
    run = ActivationRun(out)
    assert run.manifest["router"] == {"num_experts": num_experts, "top_k": top_k}
    assert run.manifest["rows"] == stored
    for (rid, layer), (pos, _, rows) in published.items():
        got_pos, ids, weights = run.router_rows(rid, layer)
        assert np.array_equal(got_pos, pos)
        assert np.array_equal(ids, rows[:, :top_k].numpy().astype(np.int64)), (rid, layer)
        assert np.array_equal(weights, rows[:, top_k:].numpy()), (rid, layer)
    # ... and HF datasets reads the same rows.
    shards = [str(p) for p in run.shards(3, "router")]
    ds = datasets.load_dataset("arrow", data_files=shards, split="train", cache_dir=str(tmp_path))
    assert len(ds) == want["3"]["tokens"]
    ids = np.asarray(ds["activation"], np.float32)[:, :top_k].astype(np.int64).ravel()
    assert np.bincount(ids, minlength=num_experts).tolist() == want["3"]["counts"]
