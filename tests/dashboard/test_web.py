"""The shared statistics and the web dashboard, against a real publisher with
synthetic activations (the engine test is test_dashboard_engine.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from actbus.bus import Batch, Publisher
from actbus.wire import Header, RequestEnd, RowIndex
from consumers.stats import OTHER_TAG, ActivationStats, BusHealth, RecentRequests, StatsConfig
from tests.support.dashboard_procs import DashboardProc
from tests.support.procs import ROOT, wait_for


def batch(step, x, layer=0, hook="post_block", rids=("r",), tags=None, positions=None, ended=()):
    n = x.shape[0]
    per = n // len(rids)
    offsets = np.array([i * per for i in range(len(rids))] + [n])
    ri = RowIndex(
        list(rids),
        offsets,
        np.arange(n) if positions is None else np.asarray(positions),
        np.arange(n) + 7,
        tags=list(tags) if tags else [],
    )
    h = Header(step, layer, hook, "float32", tuple(x.shape), "m", ri, ended=list(ended))
    return Batch(h, x, seq=step)


def test_norms_drift_and_outliers_follow_the_data():
    g = torch.Generator().manual_seed(1)
    s = ActivationStats(StatsConfig(reference_rows=64, ema=0.5, bins=8, outlier_batches=16))
    for step in range(16):  # the reference: N(0, 1) in 32 dims
        s.add([batch(step, torch.randn(8, 32, generator=g))])
    snap = s.snapshot()["taps"]["L0.post_block"]
    assert snap["norm_mean"] == pytest.approx(np.sqrt(32), rel=0.1)
    assert abs(snap["mean_drift"]) < 0.5 and abs(snap["var_drift"]) < 0.5
    assert snap["outlier_frac"] == 0.0
    assert sum(snap["norm_hist"]["counts"]) == 128 and len(snap["norm_hist"]["edges"]) == 9
    for step in range(16, 32):  # shifted by +3 and twice the spread; dim 5 an outlier
        x = 3 + 2 * torch.randn(8, 32, generator=g)
        x[:, 5] = 200
        s.add([batch(step, x)])
    snap = s.snapshot()["taps"]["L0.post_block"]
    assert snap["mean_drift"] > 2  # |shift| = 3*sqrt(31)+200 vs a reference spread ~ sqrt(32)
    assert snap["var_drift"] > 2  # variance about 4x (dim 5 has none)
    assert snap["outlier_frac"] == pytest.approx(1 / 32, abs=0.02)
    assert snap["rows"] == 256 and snap["batches"] == 32


def test_steps_are_counted_once_across_taps_and_tags_are_bounded():
    s = ActivationStats(StatsConfig(max_tag_values=2))
    x = torch.ones(4, 8)
    tags = [{"lang": "en"}, {"lang": "fr"}]
    for step in (0, 10, 20):
        for layer in (0, 3):
            s.add([batch(step, x, layer=layer, rids=("a", "b"), tags=tags)])
    s.add([batch(30, x, rids=("a", "b"), tags=[{"lang": "de"}, {"lang": "en"}])])
    snap = s.snapshot()
    assert snap["steps_counted"] == 4 and snap["messages"] == 7 and snap["last_step"] == 30
    assert set(snap["tags"]) == {"lang=en", "lang=fr", OTHER_TAG}
    assert snap["tags"]["lang=en"]["L0.post_block"] == {
        "rows": 8,
        "norm_mean": pytest.approx(8**0.5),
    }
    assert snap["tags"][OTHER_TAG]["L0.post_block"]["rows"] == 2 == snap["tag_overflow_rows"]
    with pytest.raises(ValueError, match=r"StatsConfig.bins: must be >= 1"):
        StatsConfig(bins=0)


def test_recent_requests_keep_per_token_norms_per_tap():
    r = RecentRequests(keep=2)
    x = torch.arange(1, 7, dtype=torch.float32)[:, None] * torch.ones(6, 4)  # row i: norm 2(i+1)
    r.add([batch(0, x, rids=("a", "b"))], [np.linalg.norm(x.numpy(), axis=1)])
    ended = [RequestEnd("a", 0, "stop")]
    r.add(
        [batch(1, x[:2], layer=3, rids=("c",), positions=[5, 6], ended=ended)], [np.array([1.0, 2])]
    )
    snap = r.snapshot("L0.post_block")
    assert [q["request_id"] for q in snap] == ["c", "b"] and r.forgotten == 1
    assert snap[1]["positions"] == [3, 4, 5] and snap[1]["norms"] == [8.0, 10.0, 12.0]
    assert snap[1]["token_ids"] == [10, 11, 12] and snap[0]["positions"] == []
    assert r.snapshot("L3.post_block")[0]["norms"] == [1.0, 2.0]


def test_one_digest_of_many_batches_equals_a_digest_per_batch():
    """Dashboards digest what arrived since their last report in one go: the figures
    must be those of digesting each batch as it came (moments, averages, outliers)."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for step in range(40):
        for layer in (0, 3):
            n = int(torch.randint(0, 9, (1,), generator=g))  # some batches have no rows
            x = (1 + step / 10) * torch.randn(n, 16, generator=g) + layer
            if step % 7 == 0 and n:
                x[:, 2] = 50.0  # an outlier dimension now and then
            batches.append(batch(step, x, layer=layer, rids=("a",)))
    cfg = StatsConfig(reference_rows=40, ema=0.2, outlier_batches=32, bins=8)
    one_by_one, at_once = ActivationStats(cfg), ActivationStats(cfg)
    norms_each = [one_by_one.add([b])[0] for b in batches]
    norms_all = at_once.add(batches)
    for a, b in zip(norms_each, norms_all, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    each, alls = one_by_one.snapshot(), at_once.snapshot()
    for key in ("messages", "rows", "steps_counted", "last_step", "tokens"):
        assert each[key] == alls[key]
    assert set(each["taps"]) == {"L0.post_block", "L3.post_block"}
    for tap, fig in each["taps"].items():
        got = alls["taps"][tap]
        for k in ("act_mean", "act_var", "mean_drift", "var_drift", "outlier_frac", "norm_mean"):
            assert got[k] == pytest.approx(fig[k], rel=1e-9, abs=1e-12), (tap, k)
        assert got["norm_hist"] == fig["norm_hist"] and got["batches"] == fig["batches"]
    assert each["taps"]["L0.post_block"]["outlier_frac"] > 0


def test_recent_requests_group_rows_by_request_and_tap_in_one_update():
    r = RecentRequests(keep=3, max_positions=5)
    msgs, norms = [], []
    for step in range(8):  # a, b, c, d decode one token a step; d starts at step 4
        rids = ("a", "b", "c", "d") if step >= 4 else ("a", "b", "c")
        x = torch.full((len(rids), 4), float(step))
        for layer in (0, 3):
            msgs.append(batch(step, x, layer=layer, rids=rids, positions=[10 + step] * len(rids)))
            norms.append(np.full(len(rids), step + layer / 10))
    # "a" is computed again at position 17 (a preemption): the last value wins.
    msgs.append(batch(9, torch.ones(1, 4), rids=("a",), positions=[17]))
    norms.append(np.array([99.0]))
    r.add(msgs, norms)
    snap = r.snapshot("L0.post_block")
    assert [q["request_id"] for q in snap] == ["a", "d", "c"] and r.forgotten == 1
    by = {q["request_id"]: q for q in snap}
    assert by["d"]["positions"] == [14, 15, 16, 17] and by["d"]["norms"] == [4.0, 5.0, 6.0, 7.0]
    # capped at 5 rows per tap: a's sixth row on and the re-computation are not kept
    assert by["a"]["positions"] == [10, 11, 12, 13, 14]
    assert by["c"]["taps"] == ["L0.post_block", "L3.post_block"]
    assert r.snapshot("L3.post_block")[1]["norms"] == [4.3, 5.3, 6.3, 7.3]
    roomy = RecentRequests(keep=3)
    roomy.add(msgs, norms)
    a = roomy.snapshot("L0.post_block")[0]
    assert a["positions"] == list(range(10, 18)) and a["norms"][-1] == 99.0


def test_bus_health_rates_come_from_counter_deltas():
    h = BusHealth(ignore=("actbus-stats",))

    def stats(step, published, sent, dropped, lag):
        return {
            "published": published,
            "last_step": step,
            "source_drops": 1,
            "subscribers": {
                "sink": {"name": "sink", "bytes_sent": sent, "dropped": dropped, "lag_steps": lag},
                "actbus-stats": {"name": "actbus-stats", "bytes_sent": 10**9, "dropped": {"x": 9}},
            },
        }

    first = h.update(stats(10, 80, 1000, {}, 0), now=100.0, tokens=50, every=10)
    assert first["steps_per_s"] == 0 and first["drops_total"] == 1
    out = h.update(stats(30, 240, 5000, {"queue_full": 3}, 7), now=102.0, tokens=70, every=10)
    assert out["steps_per_s"] == 10 and out["messages_per_s"] == 80
    assert out["bytes_per_s"] == 2000 and out["tokens_per_s"] == 100
    assert out["drops"] == {"queue_full": 3} and out["drops_total"] == 4
    assert out["lag_steps"] == {"sink": 7} and out["subscribers"] == 1
    assert not out["tokens_counted"]


def test_tokens_per_s_comes_from_the_engines_count_when_the_publisher_has_one(tmp_path):
    pub = Publisher(f"ipc://{tmp_path}/p.sock", info={"model": "m"})
    try:
        assert pub.stats()["tokens"] == 0 and pub.stats()["capture_s"] == 0
        pub.count_step(7, 0.25)
        pub.count_step(5, 0.125)
        wait_for(lambda: pub.stats()["publisher_cpu_s"] > 0, 10, "the publisher thread's CPU")
        first = pub.stats()
        assert first["tokens"] == 12 and first["capture_s"] == 0.375
    finally:
        pub.close()
    h = BusHealth()
    h.update(first, now=10.0, tokens=1, every=10)  # the sampled rows are not used
    cpu = first["publisher_cpu_s"] + 0.1
    out = h.update(
        {**first, "tokens": 612, "capture_s": 0.775, "publisher_cpu_s": cpu},
        now=12.0,
        tokens=2,
        every=10,
    )
    assert out["tokens_counted"] and out["tokens"] == 612 and out["tokens_per_s"] == 300
    # What capture cost the engine's thread, and the publisher's CPU, per second.
    assert out["capture_frac"] == pytest.approx(0.2)
    assert out["publisher_cpu_frac"] == pytest.approx(0.05)


class SyntheticPublisher:
    """A real publisher fed by a thread: two taps, two tagged requests a step."""

    def __init__(self, address: str, hz: float = 100.0, **info) -> None:
        self.pub = Publisher(address, info={"model": "synthetic", **info}, heartbeat_s=0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(hz,), daemon=True)
        self.thread.start()

    def _run(self, hz: float) -> None:
        g = torch.Generator().manual_seed(0)
        step = 0
        while not self.stop.wait(1 / hz):
            for layer in (0, 3):
                x = torch.randn(6, 32, generator=g) * (layer + 1)
                self.pub.publish(
                    batch(step, x, layer=layer, rids=("a", "b"), tags=[{"k": 1}, {"k": 2}]).header,
                    x,
                )
            step += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close()


def sse_events(url: str, n: int, timeout: float) -> list[dict]:
    """The first ``n`` data events of an SSE stream."""
    out: list[dict] = []
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        deadline = time.monotonic() + timeout
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) == n:
                    break
            assert time.monotonic() < deadline, f"only {len(out)} events in {timeout}s"
    return out


def test_dashboard_streams_live_snapshots_on_loopback_only(tmp_path):
    pub = SyntheticPublisher(f"ipc://{tmp_path}/bus.sock")
    dash = DashboardProc(
        f"ipc://{tmp_path}/bus.sock",
        tmp_path / "dash.log",
        "--interval",
        "0.3",
        "--policy",
        "sample:4",
    )
    try:
        assert dash.url.startswith("http://127.0.0.1:")
        port = int(dash.url.rsplit(":", 1)[1].strip("/"))
        lan = _lan_address()
        if lan:  # bound to loopback: another interface of this host is refused
            with pytest.raises(OSError), socket.create_connection((lan, port), timeout=2):
                pass
        wait_for(lambda: dash.snapshot().get("acts", {}).get("taps"), 30, "activation stats")
        assert dash.snapshot()["tap"] == "L3.post_block"  # default: the deepest post_block
        # It yields the CPU to the engine: niceness 10 (field 19 of /proc/PID/stat) and,
        # on every thread (the server's, the consumer's, ZeroMQ's), SCHED_IDLE.
        stat = Path(f"/proc/{dash.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[16]) == 10
        threads = [int(t.name) for t in Path(f"/proc/{dash.popen.pid}/task").iterdir()]
        assert len(threads) >= 3
        assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_IDLE}
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {10}
        assert dash.snapshot("L0.post_block")["tap"] == "L0.post_block"
        events = sse_events(f"{dash.url}events?tap=L3.post_block", 3, timeout=30)
        steps = [e["bus"]["last_step"] for e in events]
        assert steps == sorted(steps) and steps[-1] > steps[0], steps
        assert [e["version"] for e in events] == sorted({e["version"] for e in events})
        last = events[-1]
        assert last["tap"] == "L3.post_block" and last["sample_every"] == 4
        assert last["model"] == "synthetic" and last["bus_ok"]
        assert set(last["acts"]["taps"]) == {"L0.post_block", "L3.post_block"}
        assert last["acts"]["taps"]["L3.post_block"]["norm_mean"] == pytest.approx(
            4 * np.sqrt(32), rel=0.2
        )
        assert {q["request_id"] for q in last["requests"]} == {"a", "b"}
        assert all(q["norms"] for q in last["requests"])
        assert last["bus"]["lag_steps"].keys() == {"dashboard"}
        # The page and its assets are served locally and name nothing on the internet.
        page = urllib.request.urlopen(dash.url, timeout=10).read().decode()
        assets = re.findall(r'(?:src|href)="([^"]+)"', page)
        assert assets and all(a.startswith("/static/") for a in assets), assets
        for a in assets:
            body = urllib.request.urlopen(dash.url.rstrip("/") + a, timeout=10).read().decode()
            assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", body), a
    finally:
        rc = dash.stop()
        pub.close()
    assert rc == 0, (tmp_path / "dash.log").read_text()


def test_the_dashboard_samples_at_most_five_steps_a_second_by_default(tmp_path):
    """Its default policy bounds what it costs the engine: ``sample:5/s`` takes at
    most 5 steps a second from a publisher stepping at 100 Hz, whole steps, and
    counts the rest as sampled out, not dropped."""
    pub = SyntheticPublisher(f"ipc://{tmp_path}/bus.sock", hz=100.0)
    dash = DashboardProc(f"ipc://{tmp_path}/bus.sock", tmp_path / "dash.log", "--interval", "0.3")

    def mine() -> tuple[float, dict, int]:
        """Its counters and the publisher's last step, from one consistent snapshot."""
        st = pub.pub.stats()
        return time.monotonic(), st["subscribers"].get("dashboard", {}), st["last_step"]

    try:
        wait_for(lambda: mine()[1].get("sent"), 30, "the dashboard's first sampled step")
        t0, first, step0 = mine()
        time.sleep(3.0)
        t1, last, step1 = mine()
        snap = dash.snapshot()
    finally:
        rc = dash.stop()
        pub.close()
    assert rc == 0, (tmp_path / "dash.log").read_text()
    assert last["policy"] == "sample:5/s"
    assert (snap["sample_per_s"], snap["sample_every"]) == (5.0, 1)
    taken = (last["routed"] - first["routed"]) / 2  # two taps a step, taken whole
    assert 5 <= taken <= 5 * (t1 - t0) + 2, (taken, t1 - t0)
    stepped = step1 - step0
    assert stepped > 100  # the publisher stepped far faster than the dashboard took
    skipped = (last["sampled_out"] - first["sampled_out"]) / 2
    assert abs(skipped - (stepped - taken)) <= 2, (skipped, stepped, taken)


def _lan_address() -> str | None:
    """A non-loopback address of this host, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "sometimes"], "--policy: "),
        (["--port", "70000"], "--port must be 0..65535"),
        (["--interval", "0"], "--interval must be above 0"),
        (["--bins", "0"], "--bins: must be >= 1"),
    ],
)
def test_dashboard_flags_are_checked_by_name(flags, message, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "actbus.cli", "dashboard", "--connect", "ipc:///x", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_under_fan_in_each_publisher_has_its_row_on_the_page_and_in_wandb(tmp_path):
    """Two data-parallel ranks' publishers into one dashboard: the snapshot the page
    renders has a row per publisher (rank, run, what came from it), and W&B's row a
    panel per rank."""
    from consumers.wandb_dash import flatten

    pubs = [
        SyntheticPublisher(f"ipc://{tmp_path}/rank-{r}.sock", hz=20.0, dp_rank=r) for r in (0, 1)
    ]
    dash = DashboardProc(
        f"ipc://{tmp_path}/rank-{{0..1}}.sock", tmp_path / "dash.log", "--interval", "0.3"
    )
    try:

        def both() -> dict | None:
            snap = dash.snapshot()
            rows = snap.get("publishers") or {}
            return snap if len(rows) == 2 and all(v["messages"] for v in rows.values()) else None

        snap = wait_for(both, 60, "messages from both publishers")
        for r, pub in enumerate(pubs):
            mine = snap["publishers"][f"ipc://{tmp_path}/rank-{r}.sock"]
            assert (mine["dp_rank"], mine["publisher_id"]) == (r, pub.pub.id)
            assert mine["rows"] == 6 * mine["messages"] and mine["last_step"] >= 0
        row = flatten(snap)
        assert {k for k in row if k.startswith("publishers/")} == {
            f"publishers/dp{r}/{k}" for r in (0, 1) for k in ("messages", "rows", "last_step")
        }
        page = urllib.request.urlopen(dash.url + "static/app.js", timeout=10).read().decode()
        assert "data-publisher" in page
    finally:
        rc = dash.stop()
        for pub in pubs:
            pub.close()
    assert rc == 0, (tmp_path / "dash.log").read_text()


def test_the_dashboard_ends_with_its_stream_by_default(tmp_path):
    """Issue 50: started as the README starts it, the dashboard kept waiting, and saying
    so, after the server stopped; it exits 0 once the publisher ends its stream."""
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "m", "hidden_size": 8}, heartbeat_s=0.1)
    dash = DashboardProc(address, tmp_path / "dash.log", "--interval", "0.3")
    try:
        wait_for(lambda: "dashboard" in pub.stats()["subscribers"], 30, "the dashboard")
    finally:
        pub.close(timeout=5)  # a clean stop: END
    try:
        rc = dash.popen.wait(timeout=30)
    finally:
        dash.stop()
    text = (tmp_path / "dash.log").read_text()
    assert rc == 0 and "the publisher ended the stream: stopping" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
