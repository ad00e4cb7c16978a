"""The dashboard against bad numbers, a stopped feed and pages that never read:
real publishers, a real ``actbus dashboard`` process, real sockets, a real browser."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from actbus.bus import Publisher
from consumers.stats import ActivationStats, RecentRequests, StatsConfig
from tests.dashboard.test_web import batch, sse_events
from tests.support.dashboard_procs import Browser, DashboardProc, chromium_missing
from tests.support.procs import wait_for


def _strict(text: str) -> dict:
    """JSON as a browser parses it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_nonfinite_rows_are_counted_and_left_out_of_every_figure():
    g = torch.Generator().manual_seed(3)
    clean = [torch.randn(6, 16, generator=g) for _ in range(8)]
    dirty = []
    for i, x in enumerate(clean):
        x = x.clone()
        if i % 2:  # a NaN row and an infinite row among good ones
            x = torch.cat([x, torch.full((1, 16), float("nan")), x[:1] * float("inf")])
        dirty.append(x)
    tags = [{"lang": "en"}, {"lang": "fr"}]
    config = StatsConfig(reference_rows=12, bins=8)
    seen, bad = ActivationStats(config), ActivationStats(config)
    recent = RecentRequests()
    for step, (x, y) in enumerate(zip(clean, dirty, strict=True)):
        seen.add([batch(step, x, rids=("a", "b"), tags=tags)])
        # the dirty rows go to request "b" (the second half of the rows)
        rows = [batch(step, y, rids=("a", "b"), tags=tags)]
        rows[0].header.rows.offsets[1:] = [3, y.shape[0]]
        recent.add(rows, bad.add(rows))
    want, got = seen.snapshot(), bad.snapshot()
    assert got["nonfinite_rows"] == 8 and got["taps"]["L0.post_block"]["nonfinite_rows"] == 8
    assert want["nonfinite_rows"] == 0
    for key in ("norm_mean", "norm_std", "norm_max", "act_mean", "act_var", "mean_drift"):
        assert got["taps"]["L0.post_block"][key] == pytest.approx(
            want["taps"]["L0.post_block"][key]
        ), key
    assert got["taps"]["L0.post_block"]["norm_hist"] == want["taps"]["L0.post_block"]["norm_hist"]
    for label, per in want["tags"].items():  # bad rows count in no tag
        assert got["tags"][label]["L0.post_block"]["rows"] == per["L0.post_block"]["rows"]
        assert got["tags"][label]["L0.post_block"]["norm_mean"] == pytest.approx(
            per["L0.post_block"]["norm_mean"]
        )
    json.dumps(got, allow_nan=False)  # every figure finite
    norms = recent.snapshot("L0.post_block")[0]["norms"]
    assert sum(not np.isfinite(v) for v in norms) == 2  # per token: shown as gaps (null)


class StepPublisher:
    """A real publisher stepping at ``hz``: two taps, and with ``nonfinite`` every
    third step of layer 3 holds a NaN row and an infinite row."""

    def __init__(
        self, address: str, hz: float = 50.0, requests: int = 2, nonfinite: bool = True
    ) -> None:
        self.pub = Publisher(address, info={"model": "nan"}, heartbeat_s=0.1)
        self.steps = 0
        self.nonfinite = nonfinite
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(hz, requests), daemon=True)
        self.thread.start()

    def _run(self, hz: float, requests: int) -> None:
        g = torch.Generator().manual_seed(0)
        rids = tuple(f"r{i}" for i in range(requests))
        tags = [{"k": i % 2} for i in range(requests)]
        while not self.stop.wait(1 / hz):
            step = self.steps
            for layer in (0, 3):
                x = torch.randn(4 * requests, 32, generator=g)
                if self.nonfinite and layer == 3 and step % 3 == 0:
                    x[0, 5], x[1] = float("nan"), float("inf")
                positions = np.tile(np.arange(4) + 4 * step, requests)
                b = batch(step, x, layer=layer, rids=rids, tags=tags, positions=positions)
                self.pub.publish(b.header, x)
            self.steps += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close(timeout=2)


@pytest.mark.timeout(240)
def test_nan_rows_never_stop_the_dashboard_and_the_page_says_when_its_feed_stopped(tmp_path):
    pub = StepPublisher(f"ipc://{tmp_path}/bus.sock")
    log = tmp_path / "dash.log"
    dash = DashboardProc(
        f"ipc://{tmp_path}/bus.sock", log, "--interval", "0.3", "--policy", "sample:2",
        "--stale-s", "2", "--keep-waiting",  # served on after the publisher's END
    )  # fmt: skip
    browser = None
    try:

        def counted():
            snap = dash.snapshot("L3.post_block")
            tap = snap.get("acts", {}).get("taps", {}).get("L3.post_block", {})
            return snap if tap.get("nonfinite_rows", 0) >= 6 and "norm_hist" in tap else None

        snap = wait_for(counted, 60, "non-finite rows counted on layer 3")
        assert snap["feed"] == "live" and snap["acts"]["nonfinite_rows"] >= 6
        assert snap["acts"]["taps"]["L0.post_block"]["nonfinite_rows"] == 0
        assert np.isfinite(snap["acts"]["taps"]["L3.post_block"]["norm_mean"])
        with urllib.request.urlopen(f"{dash.url}events?tap=L3.post_block", timeout=30) as r:
            for raw in r:  # the first snapshot event parses as a browser would parse it
                if raw.startswith(b"data: "):
                    event = _strict(raw[6:].decode())
                    break
        assert event["acts"]["taps"]["L3.post_block"]["nonfinite_rows"] >= 6
        if chromium_missing() is None:
            browser = Browser(dash.url + "?tap=L3.post_block", tmp_path / "chromium")
            shown = wait_for(
                lambda: browser.eval("document.querySelector('#me-nonfinite')?.textContent"),
                60,
                "the non-finite card",
            )
            assert int(shown.replace(",", "")) >= 6
            assert browser.eval("document.querySelector('#feed').hidden") is True
        stopped_at = pub.steps
        pub.close()  # the feed stops: the page must say so
        stale = wait_for(
            lambda: (s := dash.snapshot()).get("feed") == "stale" and s, 30, "a stale feed"
        )
        assert stale["stale_s"] == 2 and stale["bus"]["last_step"] <= stopped_at
        if browser is not None:
            banner = wait_for(
                lambda: browser.eval(
                    "(b => !b.hidden && b.textContent)(document.querySelector('#feed'))"
                ),
                30,
                "the stale banner",
            )
            assert banner.startswith("Stale: no new data for over 2 s"), banner
            assert browser.eval("document.querySelector('#status').textContent") == "stale"
        assert dash.popen.poll() is None  # still serving
    finally:
        if browser is not None:
            browser.close()
        rc = dash.stop()
        pub.close()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    for sign in ("restarting consumer", "could not digest", "Traceback"):
        assert sign not in text, text[-3000:]


def _never_reading(port: int, n: int) -> list[socket.socket]:
    """``n`` pages that open ``/events`` and never read a byte."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        socks.append(s)
    return socks


@pytest.mark.timeout(240)
def test_pages_that_never_read_are_dropped_and_the_snapshot_stays_fast(tmp_path):
    n = 400
    pub = StepPublisher(f"ipc://{tmp_path}/bus.sock", requests=16, nonfinite=False)
    dash = DashboardProc(
        f"ipc://{tmp_path}/bus.sock", tmp_path / "dash.log", "--interval", "0.3",
        "--requests", "16", "--slow-client-s", "2", "--sched", "other", "--nice", "0",
    )  # fmt: skip
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: len(dash.snapshot().get("requests", [])) == 16, 60, "16 requests shown")
        port = int(dash.url.rsplit(":", 1)[1].strip("/"))
        socks = _never_reading(port, n)
        wait_for(lambda: dash.snapshot()["events"]["clients"] >= n, 60, f"{n} event streams")
        # The snapshot is timed while the pages' sends stall and until every one of
        # them is dropped (--slow-client-s 2), at least 3 s, at most 60 s.
        took = []
        start = time.monotonic()
        while time.monotonic() - start < 60:
            t0 = time.monotonic()
            snap = dash.snapshot()
            took.append(time.monotonic() - t0)
            if snap["events"]["dropped"] == n and time.monotonic() - start > 3:
                break
            time.sleep(0.25)
        median = statistics.median(took)
        print(f"/api/snapshot beside {n} pages that never read: median {median:.3f}s, "
              f"max {max(took):.3f}s, {snap['events']}")  # fmt: skip
        assert median < 0.25 and max(took) < 1.5, took
        # Their sends stalled: each is dropped and counted, nothing more made for it.
        wait_for(lambda: dash.snapshot()["events"]["dropped"] == n, 60, "the stalled pages dropped")
        assert snap["feed"] == "live"
        # A page that reads still gets every update.
        events = sse_events(f"{dash.url}events", 3, timeout=30)
        assert [e["version"] for e in events] == sorted({e["version"] for e in events})
    finally:
        for s in socks:
            s.close()
        rc = dash.stop()
        pub.close()
    assert rc == 0, (tmp_path / "dash.log").read_text()[-3000:]


@pytest.mark.timeout(240)
def test_the_wandb_consumer_logs_nonfinite_rows_and_keeps_going(tmp_path):
    from consumers.wandb_offline import find_runs, history
    from tests.support.dashboard_procs import start_wandb

    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "nan"}, heartbeat_s=0.1)
    proc = start_wandb(address, tmp_path, "--policy", "block", "--interval", "0.5", "--exit-on-end")
    try:
        wait_for(
            lambda: "wandb" in pub.stats()["subscribers"] or proc.poll() is not None,
            90,
            "the W&B consumer to subscribe",
        )
        assert proc.poll() is None, (tmp_path / "wandb-consumer.log").read_text()
        g = torch.Generator().manual_seed(0)
        for step in range(60):
            x = torch.randn(4, 16, generator=g)
            if step % 10 == 0:
                x[2, 1] = float("nan")
            pub.publish(batch(step, x, layer=3).header, x)
            time.sleep(0.01)
        wait_for(
            lambda: not pub.stats()["subscribers"]["wandb"]["inflight"], 30, "all acknowledged"
        )
        time.sleep(1.2)  # reports with the publisher still up
    finally:
        pub.close()
        rc = proc.wait(timeout=60) if proc.poll() is None else proc.returncode
    text = (tmp_path / "wandb-consumer.log").read_text()
    assert rc == 0, text[-3000:]
    assert "restarting consumer" not in text and "could not digest" not in text, text[-3000:]
    [path] = find_runs(tmp_path)
    last = history(path)[-1]
    assert last["acts/nonfinite_rows"] == 6 == last["acts/L3.post_block/nonfinite_rows"]
    assert last["acts/L3.post_block/rows"] == 240
    assert np.isfinite(last["acts/L3.post_block/norm_mean"])
