"""Monitor scores on the dashboards, without an engine: the figures ``ScoreStats``
keeps (bounded, exact), their W&B keys, and the web page in headless Chromium fed by
a real publisher sending monitor messages beside activations."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest
import torch

from actbus.bus import Batch, Publisher
from actbus.monitor.reader import Scores, split_scores
from actbus.wire import MONITOR_HOOK, Header, MonitorInfo, RequestEnd, RowIndex
from consumers.scores import ScoreStats, ScoreStatsConfig
from consumers.stats import OTHER_TAG
from consumers.wandb_dash import flatten_monitors
from tests.support.dashboard_procs import Browser, DashboardProc, chromium_missing, page_scores
from tests.support.procs import wait_for


def scores(name, layer, values, rid="r", positions=None, version=1, labels=(), tags=None, i=0):
    values = np.asarray(values, dtype=np.float32)
    if values.ndim == 1:
        values = values[:, None]
    n = len(values)
    return Scores(
        monitor=name,
        version=version,
        layer=layer,
        hook="post_block",
        step=0,
        request_id=rid,
        sample_index=i,
        positions=np.arange(n) if positions is None else np.asarray(positions),
        token_ids=np.arange(n) + 7,
        values=values,
        labels=tuple(labels),
        tags=tags or {},
    )


def test_series_figures_are_exact_and_the_threshold_follows_the_activation():
    st = ScoreStats(ScoreStatsConfig(window_rows=5))
    st.describe({"p": {"kind": "probe", "activation": "sigmoid"}, "f": {"activation": "relu"}})
    st.add([scores("p", 1, [0.1, 0.9, 0.6], version=1)])
    st.add([scores("p", 1, [0.2, 0.7, 0.3, 0.8], positions=[3, 4, 5, 6], version=2)])
    st.add([scores("f", 2, [[0.0, 2.0], [1.5, 0.0]], labels=(3, 17))])
    snap = st.snapshot()
    p = snap["series"]["p@1"]
    assert (p["monitor"], p["layer"], p["kind"], p["activation"]) == ("p", 1, "probe", "sigmoid")
    assert p["version"] == 2 and p["rows"] == 7 and p["recent_rows"] == 5 and p["messages"] == 2
    all_ = np.array([0.1, 0.9, 0.6, 0.2, 0.7, 0.3, 0.8], dtype=np.float32).astype(np.float64)
    (c,) = p["columns"]
    assert c["label"] is None and c["mean"] == pytest.approx(all_.mean(), rel=1e-12)
    recent = all_[-5:]  # the window holds the last 5 rows, cut inside the first message
    assert c["recent_mean"] == pytest.approx(recent.mean(), rel=1e-12)
    assert c["p90"] == pytest.approx(np.quantile(recent, 0.9), rel=1e-12)
    assert c["max"] == pytest.approx(0.8, rel=1e-6)
    assert p["threshold"] == 0.5 and c["above"] == pytest.approx(3 / 5)  # 0.6, 0.7, 0.8
    f = snap["series"]["f@2"]
    assert f["threshold"] == 0.0 and [x["label"] for x in f["columns"]] == [3, 17]
    assert [x["above"] for x in f["columns"]] == [0.5, 0.5]  # an SAE feature firing
    assert [x["mean"] for x in f["columns"]] == [0.75, 1.0]


def test_nonfinite_rows_columns_series_and_tags_are_bounded():
    st = ScoreStats(ScoreStatsConfig(max_columns=3, max_series=2, max_tag_values=2))
    wide = np.arange(20, dtype=np.float32).reshape(2, 10)
    st.add([scores("sae", 0, wide, labels=range(10), tags={"user": "a"})])
    st.add([scores("p", 0, [np.nan, 1.0, np.inf], tags={"user": "b"})])
    st.add([scores("q", 0, [1.0, 2.0], tags={"user": "c"})])  # a third series: counted
    st.add([scores("p", 0, [3.0], tags={"user": "<b>c</b>"})])  # a third tag: (other)
    snap = st.snapshot()
    assert set(snap["series"]) == {"sae@0", "p@0"} and snap["series_overflow_rows"] == 2
    sae = snap["series"]["sae@0"]
    assert sae["width"] == 10 and [c["label"] for c in sae["columns"]] == [0, 1, 2]
    assert [c["mean"] for c in sae["columns"]] == [5.0, 6.0, 7.0]
    p = snap["series"]["p@0"]
    assert p["rows"] == 2 and p["nonfinite_rows"] == 2 and p["columns"][0]["mean"] == 2.0
    assert set(snap["tags"]) == {"user=a", "user=b", OTHER_TAG}
    assert snap["tag_overflow_rows"] == 1
    assert snap["tags"]["user=a"]["sae@0"] == {"rows": 2, "means": [5.0, 6.0, 7.0]}
    assert snap["tags"]["user=b"]["p@0"] == {"rows": 1, "means": [1.0]}
    assert snap["tags"][OTHER_TAG]["p@0"] == {"rows": 1, "means": [3.0]}


def test_recent_requests_keep_their_per_token_scores_bounded():
    st = ScoreStats(ScoreStatsConfig(keep_requests=2, max_positions=4, request_columns=2))
    st.add([scores("f", 1, [[1, 2, 3], [4, 5, 6]], rid="a", positions=[2, 3], tags={"k": 1})])
    st.add([scores("f", 1, [[7, 8, 9]], rid="a", positions=[1])])  # out of order: sorted
    st.add([scores("p", 3, np.arange(6), rid="b")])  # 6 positions: the first 4 kept
    st.add([scores("p", 3, [0.5], rid="a", positions=[0], i=1)])  # a's second sample
    st.add([], ended=[RequestEnd("b", 0, "length"), RequestEnd("zzz", 0, "stop")])
    reqs = st.snapshot()["requests"]
    assert [(r["request_id"], r["sample_index"]) for r in reqs] == [("a", 1), ("b", 0)]
    assert st.requests_forgotten == 1  # ("a", 0), the least recently updated
    assert reqs[1]["ended"] == "length" and reqs[0]["ended"] == ""
    assert reqs[1]["series"]["p@3"] == {"positions": [0, 1, 2, 3], "values": [[0, 1, 2, 3]]}
    st2 = ScoreStats(ScoreStatsConfig(request_columns=2))
    st2.add([scores("f", 1, [[1, 2, 3], [4, 5, 6]], rid="a", positions=[2, 3], tags={"k": 1})])
    st2.add([scores("f", 1, [[7, 8, 9]], rid="a", positions=[1])])
    (r,) = st2.snapshot()["requests"]
    assert r["tags"] == {"k": 1}
    assert r["series"]["f@1"] == {"positions": [1, 2, 3], "values": [[7, 1, 4], [8, 2, 5]]}
    none = ScoreStats(ScoreStatsConfig(keep_requests=0))
    none.add([scores("p", 0, [1.0])])
    assert none.snapshot()["requests"] == [] and none.snapshot()["series"]["p@0"]["rows"] == 1


def test_config_fields_are_checked_by_name():
    with pytest.raises(ValueError, match=r"ScoreStatsConfig\.window_rows: must be >= 1"):
        ScoreStatsConfig(window_rows=0)
    with pytest.raises(ValueError, match=r"ScoreStatsConfig\.keep_requests: must be >= 0"):
        ScoreStatsConfig(keep_requests=-1)


def test_wandb_keys_are_under_monitor():
    st = ScoreStats()
    st.describe({"toxic": {"activation": "sigmoid"}, "f/x": {"activation": "relu"}})
    st.add([scores("toxic", 16, [0.25, 0.75], version=3, tags={"split": "eval"})])
    st.add([scores("f/x", 2, [[1.0, 0.0]], labels=(5, 9))])
    row = flatten_monitors(st.snapshot())
    assert row["monitor/toxic/L16/version"] == 3 and row["monitor/toxic/L16/rows"] == 2
    assert row["monitor/toxic/L16/c0/mean"] == 0.5
    assert row["monitor/toxic/L16/c0/above"] == 0.5 and row["monitor/toxic/L16/c0/max"] == 0.75
    assert row["monitor/f_x/L2/f5/mean"] == 1.0 and row["monitor/f_x/L2/f9/mean"] == 0.0
    assert row["monitor/tags/split=eval/toxic.L16/c0/mean"] == 0.5
    assert row["monitor/tags/split=eval/toxic.L16/rows"] == 2
    assert all(k.startswith("monitor/") for k in row)


def score_header(step, name, layer, values, rids, tags, version=1, labels=(), ended=()):
    n = values.shape[0]
    per = n // len(rids)
    ri = RowIndex(
        list(rids),
        np.array([i * per for i in range(len(rids))] + [n]),
        np.arange(n) + 100 * step,
        np.arange(n) + 7,
        tags=list(tags),
    )
    mon = MonitorInfo(name, version, "post_block", tuple(labels))
    return Header(step, layer, MONITOR_HOOK, "float32", tuple(values.shape), "m", ri,
                  ended=list(ended), monitor=mon)  # fmt: skip


def test_split_scores_cuts_a_message_per_request():
    v = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    h = score_header(3, "f", 2, v, ("a", "b"), [{"k": 1}, {}], version=4, labels=(5, 6))
    out = split_scores(Batch(h, v, seq=0))
    assert [(s.request_id, s.version, s.layer, s.labels, s.tags) for s in out] == [
        ("a", 4, 2, (5, 6), {"k": 1}),
        ("b", 4, 2, (5, 6), {}),
    ]
    assert out[1].positions.tolist() == [302, 303] and out[1].values.tolist() == [[4, 5], [6, 7]]
    assert split_scores(Batch(h, v, seq=0), frozenset({"g"})) == []


class ScorePublisher:
    """A real publisher whose WELCOME lists two monitors; it sends activations and both
    monitors' scores of two tagged requests each step. ``sent``: every score sent."""

    MONITORS: ClassVar[dict] = {
        "probe": {"layers": [1], "hook": "post_block", "kind": "probe", "width": 1,
                  "labels": [], "activation": "sigmoid"},
        "feats": {"layers": [1], "hook": "post_block", "kind": "sae", "width": 2,
                  "labels": [4, 9], "activation": "relu"},
    }  # fmt: skip

    def __init__(self, address: str, steps: int, **info) -> None:
        self.pub = Publisher(
            address,
            info={"model": "synthetic", "layers": [1], "hooks": ["post_block"], **info},
            heartbeat_s=0.1,
        )
        self.steps = steps
        self.sent: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
        self.go = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.go.wait()
        for step in range(self.steps):
            rids, tags = ("a", "b"), [{"split": "train"}, {"split": "<i>eval</i>"}]
            x = torch.randn(4, 16, generator=g)
            ri = RowIndex(list(rids), np.array([0, 2, 4]), np.arange(4), np.arange(4), tags=tags)
            self.pub.publish(Header(step, 1, "post_block", "float32", (4, 16), "m", ri), x)
            for name, width, labels in (("probe", 1, ()), ("feats", 2, (4, 9))):
                v = torch.rand(4, width, generator=g)
                ended = [RequestEnd(r, 0, "length") for r in rids] if step == self.steps - 1 else ()
                h = score_header(step, name, 1, v, rids, tags, 1 + step // 10, labels, ended)
                self.pub.publish(h, v)
                for j, r in enumerate(rids):
                    for k in range(2):
                        row = 2 * j + k
                        self.sent.setdefault((name, r), []).append(
                            (100 * step + row, v[row].numpy())
                        )
            self.done.wait(0.02)
        self.done.set()

    def close(self) -> None:
        self.go.set()
        self.done.set()
        self.thread.join(timeout=5)
        self.pub.close()


def test_the_page_shows_the_monitor_scores_the_bus_sent(tmp_path):
    """Every score the publisher sent is on the page: per series and column the rows,
    mean and version, per tag the means (the tag's markup shown as text), and per
    request each token's score, bit for bit."""
    why = chromium_missing()
    address = f"ipc://{tmp_path}/bus.sock"
    pub = ScorePublisher(address, steps=25, monitors=ScorePublisher.MONITORS)
    dash = DashboardProc(address, tmp_path / "dash.log", "--interval", "0.2")
    browser = None
    try:
        wait_for(
            lambda: dash.snapshot().get("bus", {}).get("subscribers") == 2, 30, "both subscriptions"
        )
        pub.go.set()
        assert pub.done.wait(30)
        total = 25 * 4

        def complete():
            m = dash.snapshot()["monitors"]
            return (
                m if all(s["rows"] == total for s in m["series"].values()) and m["series"] else None
            )

        m = wait_for(complete, 30, "every score on the dashboard")
        assert m["subscribed"] and m["missed"] == 0 and m["error"] is None
        assert set(m["series"]) == {"probe@1", "feats@1"}
        assert m["series"]["probe@1"]["version"] == 3 and m["series"]["probe@1"]["threshold"] == 0.5
        if why is not None:
            pytest.skip(f"the snapshot holds every score; the page was not checked: {why}")
        browser = Browser(dash.url, tmp_path / "chromium")
        page = wait_for(
            lambda: (p := page_scores(browser))["rows"] and p["rows"][0]["rows"] == total and p,
            30,
            "the monitor panel",
        )
    finally:
        if browser is not None:
            browser.close()
        rc = dash.stop()
        pub.close()
    assert rc == 0, (tmp_path / "dash.log").read_text()
    # Per series and column: what was sent, summarised.
    got = {(r["series"], r["col"]): r for r in page["rows"]}
    assert set(got) == {("probe@1", 0), ("feats@1", 0), ("feats@1", 1)}
    assert [got["feats@1", c]["column"] for c in (0, 1)] == ["f4", "f9"]
    for (series, col), r in got.items():
        name = series.split("@")[0]
        sent = np.array([v[col] for rid in "ab" for _, v in pub.sent[name, rid]], np.float64)
        assert r["rows"] == total and r["version"] == 3
        assert r["mean"] == pytest.approx(sent.mean(), rel=1e-9)
        threshold = 0.5 if name == "probe" else 0.0
        assert float(r["above"]) == pytest.approx((sent > threshold).mean())
    # Per tag: the markup in a tag value is text, not HTML.
    assert page["html_tags"] == 0
    tagged = {(t["text"], t["series"], t["col"]): t["mean"] for t in page["tags"]}
    sent_a = np.array([v[0] for _, v in pub.sent["probe", "a"]], np.float64)
    sent_b = np.array([v[0] for _, v in pub.sent["probe", "b"]], np.float64)
    assert tagged["split=train", "probe@1", 0] == pytest.approx(sent_a.mean(), rel=1e-9)
    assert tagged["split=<i>eval</i>", "probe@1", 0] == pytest.approx(sent_b.mean(), rel=1e-9)
    # Per request: each token's score as sent, to the bit.
    lines = {(q["request"], q["series"], q["col"]): q for q in page["requests"]}
    assert {k[0] for k in lines} == {"a", "b"} and len(lines) == 6
    for (rid, series, col), q in lines.items():
        sent = dict((p, v[col]) for p, v in pub.sent[series.split("@")[0], rid])
        assert len(q["positions"]) == len(sent)
        assert np.array_equal(
            np.array(q["values"], np.float32), np.array([sent[p] for p in q["positions"]])
        )


def test_no_monitor_scores_flag_leaves_them_out(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = ScorePublisher(address, steps=5, monitors=ScorePublisher.MONITORS)
    dash = DashboardProc(address, tmp_path / "dash.log", "--interval", "0.2", "--no-monitor-scores")
    try:
        pub.go.set()
        snap = wait_for(
            lambda: (s := dash.snapshot()).get("acts", {}).get("taps") and s, 30, "activations"
        )
        assert snap["bus"]["lag_steps"].keys() == {"dashboard"}  # no scores subscription
        assert snap["monitors"]["series"] == {} and not snap["monitors"]["subscribed"]
    finally:
        rc = dash.stop()
        pub.close()
    assert rc == 0, (tmp_path / "dash.log").read_text()


def test_wandb_logs_the_monitor_scores_the_bus_sent(tmp_path):
    from consumers.wandb_offline import find_runs, history
    from tests.support.dashboard_procs import start_wandb
    from tests.support.procs import stop

    address = f"ipc://{tmp_path}/bus.sock"
    pub = ScorePublisher(address, steps=25, monitors=ScorePublisher.MONITORS)
    proc = start_wandb(address, tmp_path, "--interval", "0.2", "--exit-on-end")
    try:
        wait_for(
            lambda: (
                {"wandb", "wandb-scores"} <= pub.pub.stats()["subscribers"].keys()
                or proc.poll() is not None
            ),
            90,
            "the W&B consumer to subscribe to activations and scores",
        )
        assert proc.poll() is None, (tmp_path / "wandb-consumer.log").read_text()
        pub.go.set()
        assert pub.done.wait(30)
        wait_for(
            lambda: not pub.pub.stats()["subscribers"]["wandb-scores"]["inflight"],
            30,
            "the scores to be read",
        )
    finally:
        pub.close()
        rc = proc.wait(timeout=60) if proc.poll() is None else stop(proc)
    assert rc == 0, (tmp_path / "wandb-consumer.log").read_text()
    [path] = find_runs(tmp_path)
    last = history(path)[-1]
    for name, cols in (("probe", ("c0",)), ("feats", ("f4", "f9"))):
        assert last[f"monitor/{name}/L1/rows"] == 100 and last[f"monitor/{name}/L1/version"] == 3
        for i, col in enumerate(cols):
            sent = np.array([v[i] for rid in "ab" for _, v in pub.sent[name, rid]], np.float64)
            assert last[f"monitor/{name}/L1/{col}/mean"] == pytest.approx(sent.mean(), rel=1e-9)
            assert last[f"monitor/{name}/L1/{col}/max"] == pytest.approx(sent.max(), rel=1e-6)
        train = np.array([v[0] for _, v in pub.sent[name, "a"]], np.float64)
        key = f"monitor/tags/split=train/{name}.L1/{cols[0]}/mean"
        assert last[key] == pytest.approx(train.mean(), rel=1e-9)
