"""Monitors without an engine: config and request validation, weights, the wire."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
import torch

from actbus.bus.protocol import Subscription
from actbus.capture.taps import install_taps
from actbus.config import CaptureConfig
from actbus.errors import ConfigError
from actbus.monitor.config import MonitorConfig
from actbus.monitor.frontend import take_monitors
from actbus.monitor.graph import Segment, install_monitors, monitor_point, monitor_scores
from actbus.monitor.swap import TableSwap
from actbus.monitor.weights import MonitorWeights, load_weights
from actbus.wire import MONITOR_HOOK, Header, MonitorInfo, RowIndex, WireError

W = [0.5, -0.25, 0.0, 1.0]
GOOD = {
    "monitors": {
        "a": {"weight": W, "bias": 0.1, "layers": [1], "sigmoid": True},
        "b": {"weight": W, "layers": [0, 2], "hook": "pre_attn"},
    },
    "global": ["a"],
}


def _bad(raw, msg):
    with pytest.raises(ConfigError, match=msg):
        MonitorConfig.from_dict(raw)


def test_config_parses_and_sits_in_the_actbus_entry():
    cfg = CaptureConfig.from_dict({"layers": [0], "monitor": GOOD}).monitor
    assert cfg is not None and list(cfg.monitors) == ["a", "b"]
    assert cfg.global_monitors == ("a",)
    assert cfg.monitors["b"].points == [(0, "pre_attn"), (2, "pre_attn")]
    assert cfg.monitors["a"].sigmoid is True and cfg.monitors["a"].bias == 0.1


@pytest.mark.parametrize(
    ("raw", "msg"),
    [
        ([], r"actbus.monitor: expected a mapping"),
        ({"monitors": {}}, r"actbus.monitor.monitors: expected a non-empty mapping"),
        ({"monitors": {"a": {"weight": W}}}, r"actbus.monitor.monitors.a.layers: required"),
        ({"monitors": {"a": {"weight": W, "layers": [-1]}}}, r"monitors.a.layers\[0\]"),
        ({"monitors": {"a": {"weight": W, "layers": [0], "hook": "x"}}}, r"monitors.a.hook"),
        ({"monitors": {"a": {"weight": [1.0, float("nan")], "layers": [0]}}}, r"weight\[1\]"),
        ({"monitors": {"a": {"weight": W, "layers": [0], "bias": "1"}}}, r"monitors.a.bias"),
        ({"monitors": {"a": {"weight": W, "layers": [0], "feature": 1}}}, r"monitors.a.feature"),
        ({"monitors": {"a": {"sae": "d", "layers": [0]}}}, r"monitors.a.features: expected"),
        ({"monitors": {"a": {"sae": "d", "features": [1, 1], "layers": [0]}}}, r"twice"),
        ({"monitors": {"a": {"probe": "d", "sae": "e", "layers": [0]}}}, r"exactly one"),
        ({"monitors": {"a": {"probe": "", "layers": [0]}}}, r"monitors.a.probe"),
        ({"monitors": {"a": {"probe": "d", "layers": [0], "sigmoid": 1}}}, r"a.sigmoid"),
        ({"monitors": {"a": {"weight": W, "layers": [0]}}, "global": ["z"]}, r"global\[0\]"),
        ({"monitors": {"a": {"weight": W, "layers": [0]}}, "x": 1}, r"actbus.monitor.x"),
    ],
)
def test_config_errors_name_the_field(raw, msg):
    _bad(raw, msg)


def test_layers_are_checked_against_the_model():
    cfg = MonitorConfig.from_dict(GOOD)
    cfg.check_model(3)
    with pytest.raises(ConfigError, match=r"monitors.b.layers\[1\]: layer 2 is out of range"):
        cfg.check_model(2)


def test_requests_select_monitors_and_opt_out_of_global():
    cfg = MonitorConfig.from_dict(GOOD)
    assert take_monitors({"monitor": ["b"]}, cfg) == (None, ("a", "b"), False)
    assert take_monitors({"monitor": "b", "monitor_global": False}, cfg) == (None, ("b",), False)
    assert take_monitors({"monitor_global": False}, cfg) == (None, (), False)
    assert take_monitors({"layers": [0], "monitor": ["b"]}, cfg) == (
        {"layers": [0]},
        ("a", "b"),
        False,
    )
    assert take_monitors(None, cfg) == (None, ("a",), False)
    assert take_monitors({"layers": [0]}, None) == ({"layers": [0]}, (), False)
    assert take_monitors({"monitor_return": True}, cfg) == (None, ("a",), True)
    for raw, msg in [
        ({"monitor": ["zz"]}, r"extra_args.actbus.monitor\[0\]: no monitor named 'zz'"),
        ({"monitor": []}, r"extra_args.actbus.monitor: expected a monitor name"),
        ({"monitor": [1]}, r"extra_args.actbus.monitor\[0\]"),
        ({"monitor_global": 0}, r"extra_args.actbus.monitor_global: expected true or false"),
        ({"monitor_return": 1}, r"extra_args.actbus.monitor_return: expected true or false"),
        (
            {"monitor_global": False, "monitor_return": True},
            r"extra_args.actbus.monitor_return: this request has no monitors to return",
        ),
    ]:
        with pytest.raises(ConfigError, match=msg):
            take_monitors(raw, cfg)
    with pytest.raises(ConfigError, match=r"this engine has no monitors"):
        take_monitors({"monitor": ["a"]}, None)


def test_weights_are_checked_for_width_and_values():
    cfg = MonitorConfig.from_dict(GOOD)
    mw = load_weights(cfg.monitors["a"], 4, "m.a")
    assert mw.activation == "sigmoid" and mw.published == (0,)
    with pytest.raises(ConfigError, match=r"m.a: the weights are \[1, 4\] wide; .* has 8"):
        load_weights(cfg.monitors["a"], 8, "m.a")
    bad = MonitorWeights(
        np.array([[np.inf, 0, 0, 0]], np.float32), np.zeros(1, np.float32), "linear", np.zeros(1)
    )
    with pytest.raises(ConfigError, match=r"x: the weights hold NaN or Inf"):
        bad.check(4, "x")


def test_tables_hold_each_point_and_bump_versions_on_write():
    cfg = MonitorConfig.from_dict(GOOD)
    weights = {n: load_weights(d, 4, n) for n, d in cfg.monitors.items()}
    decoder = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    points = {n: d.points for n, d in cfg.monitors.items()}
    t = install_monitors(
        decoder, weights, points, hidden_size=4, max_rows=8, device=torch.device("cpu")
    )
    assert sorted(t.points) == [(0, "pre_attn"), (1, "post_block"), (2, "pre_attn")]
    assert t.versions == {"a": 1, "b": 1}
    assert decoder[1]._actbus_monitor == {"post_block": (Segment(0, 1, "sigmoid"),)}
    addr = t.points[(0, "pre_attn")].weight.data_ptr()
    new = MonitorWeights(
        np.ones((1, 4), np.float32), np.zeros(1, np.float32), "linear", np.zeros(1, np.float32)
    )
    assert t.write("b", new) == 2 and t.versions["a"] == 1
    assert t.points[(0, "pre_attn")].weight.data_ptr() == addr  # in place: graphs keep reading it
    assert torch.equal(t.points[(2, "pre_attn")].weight, torch.ones(2, 1, 4))  # both slots


def test_swaps_flip_the_front_slot_whole_and_the_compiled_graph_follows():
    """A swap writes the back slot (the front one, with the pushed monitor's columns
    replaced) and flips ``front``: the compiled forward reads the new weights with no
    recompile, at the same addresses, and a monitor sharing the point keeps its own."""
    torch._dynamo.reset()
    cfg = MonitorConfig.from_dict(
        {"monitors": {"a": {"weight": W, "layers": [0]}, "b": {"weight": W, "layers": [0]}}}
    )
    weights = {n: load_weights(d, 4, n) for n, d in cfg.monitors.items()}
    layer = torch.nn.Module()
    t = install_monitors(
        torch.nn.ModuleList([layer]),
        weights,
        {n: d.points for n, d in cfg.monitors.items()},
        hidden_size=4,
        max_rows=8,
        device=torch.device("cpu"),
    )
    pt = t.points[(0, "post_block")]
    counter = {"n": 0}

    def backend(gm, _inputs):
        counter["n"] += 1
        return gm.forward

    def score(x):
        monitor_point(layer, "post_block", x)
        return pt.scores[: x.shape[0]].clone()

    fn = torch.compile(score, backend=backend, dynamic=True)
    x = torch.randn(5, 4)
    w0 = torch.tensor(W)
    torch.testing.assert_close(fn(x), torch.stack([x @ w0, x @ w0], dim=1))
    addrs = [b.data_ptr() for b in (pt.weight, pt.bias, pt.theta, pt.front)]
    swap = TableSwap.of(t)
    for i, scale in enumerate((2.0, -3.0, 0.5)):
        new = MonitorWeights(
            (w0 * scale).numpy()[None], np.full(1, scale, np.float32), "linear", np.zeros(1)
        )
        assert swap.swap({"b": new}) == [(0, "post_block")]
        assert pt.slot == (i + 1) % 2 and int(pt.front) == pt.slot
        want = torch.stack([x @ w0, x @ w0 * scale + scale], dim=1)
        torch.testing.assert_close(fn(x), want)
        torch.testing.assert_close(pt.read()[0], torch.stack([w0, w0 * scale]))
    assert swap.swap({"nowhere": new}) == []
    assert counter["n"] == 1
    assert addrs == [b.data_ptr() for b in (pt.weight, pt.bias, pt.theta, pt.front)]
    with pytest.raises(ValueError, match="monitor b: 2 columns, its table holds 1"):
        swap.swap({"b": MonitorWeights(np.ones((2, 4), np.float32), np.zeros(2), "linear", None)})


def test_compiled_scores_follow_new_weights_without_recompiling():
    """The tables are inputs of the compiled function: new values, same graph."""
    torch._dynamo.reset()
    w, b, th = torch.randn(3, 8), torch.randn(3), torch.full((3,), 0.2)
    segs = (Segment(0, 1, "sigmoid"), Segment(1, 3, "jumprelu"))
    counter = {"n": 0}

    def backend(gm, _inputs):
        counter["n"] += 1
        return gm.forward

    fn = torch.compile(monitor_scores, backend=backend, dynamic=True)
    x = torch.randn(5, 8)
    torch.testing.assert_close(fn(x, w, b, th, segs), monitor_scores(x, w, b, th, segs))
    w.copy_(torch.randn(3, 8))
    torch.testing.assert_close(fn(x, w, b, th, segs), monitor_scores(x, w, b, th, segs))
    assert counter["n"] == 1


def _hdr(**kw) -> Header:
    rows = RowIndex(["r"], np.array([0, 2]), np.array([0, 1]), np.array([5, 6]))
    base = dict(
        step=3,
        layer=1,
        hook=MONITOR_HOOK,
        dtype="float32",
        shape=(2, 2),
        model="m",
        rows=rows,
        monitor=MonitorInfo("feats", 4, "post_attn", (7, 9)),
    )
    base.update(kw)
    return Header(**base)


def test_monitor_headers_round_trip_and_are_checked_at_decode():
    h = Header.decode(_hdr().encode())
    assert h.monitor == MonitorInfo("feats", 4, "post_attn", (7, 9)) and h.hook == MONITOR_HOOK

    def tampered(**fields):
        d = msgpack.unpackb(_hdr().encode(), raw=False)
        d.update(fields)
        return msgpack.packb(d, use_bin_type=True)

    for fields, field in [
        ({"monitor": None}, "monitor"),
        ({"monitor": ["feats", 0, "post_attn", [7, 9]]}, "monitor"),  # version from 1
        ({"monitor": ["feats", 1, "nowhere", [7, 9]]}, "monitor"),
        ({"monitor": ["", 1, "post_attn", [7, 9]]}, "monitor"),
        ({"monitor": ["x" * 201, 1, "post_attn", [7, 9]]}, "monitor"),
        ({"monitor": ["feats", 1, "post_attn", [7]]}, "monitor"),  # labels != width
        ({"monitor": ["feats", 1, "post_attn", [-1, 2]]}, "monitor"),
        ({"monitor": ["feats", 1, "post_attn"]}, "monitor"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"hook": "post_block"}, "monitor"),  # a monitor field on an activation message
    ]:
        with pytest.raises(WireError) as e:
            Header.decode(tampered(**fields))
        assert e.value.field == field, (fields, e.value.field, str(e.value))
    d = msgpack.unpackb(_hdr().encode(), raw=False)
    del d["monitor"]
    with pytest.raises(WireError, match="missing on a monitor message"):
        Header.decode(msgpack.packb(d, use_bin_type=True))


def test_scores_go_only_to_subscribers_that_name_the_monitor_hook():
    assert not Subscription().wants(1, MONITOR_HOOK)
    assert not Subscription(hooks=("post_block",)).wants(1, MONITOR_HOOK)
    assert Subscription(hooks=(MONITOR_HOOK,)).wants(1, MONITOR_HOOK)
    assert not Subscription(hooks=(MONITOR_HOOK,)).wants(1, "post_block")
    assert not Subscription(hooks=(MONITOR_HOOK,), layers=(2,)).wants(1, MONITOR_HOOK)


def test_returned_scores_json_is_exact_float32_and_small():
    """The HTTP form: each value is the shortest decimal that reads back as the same
    float32 (so a client recovers the exact bits), non-finite ones are null."""
    from actbus.monitor.returns import MonitorScores

    rng = np.random.default_rng(0)
    vals = rng.standard_normal((50, 3)).astype(np.float32) * np.float32(1e-3)
    vals[0, 0], vals[1, 1] = np.float32(0.1), np.float32(np.inf)
    ms = MonitorScores(
        torch.arange(50),
        torch.arange(50) + 7,
        {("f", 2): torch.from_numpy(vals)},
        {("f", 2): torch.ones(50, dtype=torch.int64)},
        {"f": (3, 9, 11)},
        complete=True,
    )
    out = json.loads(json.dumps(ms.to_json(final=True)))
    assert out["positions"] == list(range(50)) and out["token_ids"][0] == 7
    assert out["complete"] is True
    (entry,) = out["scores"]["f"]
    assert entry["layer"] == 2 and entry["labels"] == [3, 9, 11] and entry["version"] == [1] * 50
    back = np.array([[np.nan if v is None else v for v in row] for row in entry["values"]])
    finite = np.isfinite(vals)
    assert entry["values"][1][1] is None and not np.isfinite(back[1, 1])
    assert (back.astype(np.float32)[finite] == vals[finite]).all()  # bitwise
    assert '"values": [[0.1,' in json.dumps(ms.to_json(final=True))  # shortest, not 0.100000001
    assert "complete" not in ms.to_json(final=False)
    assert torch.equal(ms["f"], torch.from_numpy(vals)) and ms["f", 2] is ms.values[("f", 2)]
    with pytest.raises(KeyError, match="no monitor 'g'"):
        ms["g"]


def test_returned_scores_join_delta_pieces():
    from actbus.monitor.returns import MonitorScores

    def piece(lo, hi, ver):
        n = hi - lo
        return MonitorScores(
            torch.arange(lo, hi),
            torch.arange(lo, hi),
            {("p", 0): torch.full((n, 1), float(lo))},
            {("p", 0): torch.full((n,), ver)},
            {},
            complete=hi == 9,
        )

    j = MonitorScores.join(MonitorScores.join(None, piece(0, 4, 1)), piece(4, 9, 2))
    assert j.positions.tolist() == list(range(9)) and j.complete
    assert j.versions[("p", 0)].tolist() == [1] * 4 + [2] * 5


def test_a_score_series_grows_and_keeps_handed_out_views():
    """Regions grow past their first size; rows a DELTA reader took are let go, and
    views handed out before a growth keep their values; one message's rows for many
    requests land in each request's own region."""
    from actbus.monitor.returns import _StreamRows
    from actbus.wire import RowIndex

    def message(lo, n, value, slots=(0,)):
        k = len(slots)
        pos = np.tile(np.arange(lo, lo + n), k)
        rows = RowIndex([f"r{s}" for s in slots], np.arange(k + 1) * n, pos, pos)
        vals = np.repeat(np.array([[value + s] * 2 for s in slots], np.float32), n, axis=0)
        return rows, vals

    s = _StreamRows(4)
    s.width = 2
    slots = np.array([0])
    first_cap = np.array([4])

    def write(lo, n, value, version, which=slots):
        rows, vals = message(lo, n, value, tuple(which.tolist()))
        k = len(which)
        offs = np.arange(k) * n
        s.write(which, offs, np.full(k, n), True, rows, vals, version, np.full(k, 4))

    write(0, 3, 1.0, 1)
    st = s.stores[int(s.sid[0])]
    b = int(s.base[0])
    first = st.val[b : b + 3]
    s.start[0] += 3  # handed out (DELTA)
    for lo in range(3, 40, 5):
        write(lo, 5, float(lo), 2)
    assert (first == 1).all()  # the old view survived the growths
    assert s.pending_below(0, 100) == 40 and s.pending_below(0, 10) == 7
    assert s.held_below(0, 10) == 10
    st, b = s.stores[int(s.sid[0])], int(s.base[0])
    lo, hi = b + int(s.start[0]), b + int(s.end[0])
    assert st.pos[lo:hi].tolist() == list(range(3, 43))
    assert (st.ver[lo:hi] == 2).all() and st.val[lo + 5, 0] == 8
    assert int(s.cap[0]) < 2 * 43  # taken rows were dropped, not kept
    assert first_cap[0] == 4
    # Two more requests, one message: each its own rows, one scatter.
    write(0, 1, 100.0, 3, np.array([1, 2]))
    for slot in (1, 2):
        st, b = s.stores[int(s.sid[slot])], int(s.base[slot])
        assert st.val[b, 0] == 100 + slot and st.ver[b] == 3 and s.end[slot] == 1


def test_compiled_monitors_score_the_streams_rounded_as_captured():
    """In bf16, inductor fuses a pointwise op that makes the stream (``hidden +
    residual``; the add inside vLLM's fused add-and-norm that yields ``post_attn``; a
    family's post-MLP norm) into the float32 read after it and skips rounding it: a
    monitor there would score a stream that capture (which rounds) and HF transformers
    never had. Scores of the compiled bf16 model at every hook equal the rounded
    stream's (the ReLU SAE at post_attn was 1e-2 of its pre-activations off before)."""
    from actbus.engine.layers import wrap_layer

    torch._dynamo.reset()
    d = 64
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(d, generator=gen) / d**0.5).tolist()
    hooks = ("pre_attn", "post_attn", "mlp_out", "post_block")
    cfg = MonitorConfig.from_dict(
        {"monitors": {h: {"weight": w, "bias": 0.5, "layers": [1], "hook": h} for h in hooks}}
    )

    class Layer(torch.nn.Module):  # shaped like vLLM's: (hidden_states, residual)
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(d, d, dtype=torch.bfloat16)

        def mlp(self, x):  # a post-MLP norm: float32 math, rounded to bf16 at the end
            h = self.lin(x).float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()

        def forward(self, positions, hidden_states, residual):
            residual = hidden_states if residual is None else hidden_states + residual
            return self.mlp(residual), residual

    layers = torch.nn.ModuleList(Layer() for _ in range(2))
    taps = install_taps(
        layers,
        layers=(1,),
        hooks=hooks,
        hidden_size=d,
        max_rows=32,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    for layer in layers:
        wrap_layer(layer)
    weights = {n: load_weights(c, d, n) for n, c in cfg.monitors.items()}
    t = install_monitors(
        layers,
        weights,
        {n: c.points for n, c in cfg.monitors.items()},
        hidden_size=d,
        max_rows=32,
        device=torch.device("cpu"),
    )

    def run(x):  # the wrapped layers: rows and scores land in the points' buffers
        hidden, residual = x, None
        for layer in layers:
            hidden, residual = layer(torch.arange(x.shape[0]), hidden, residual)
        return hidden, residual

    x = (30 * torch.randn(9, d, generator=gen)).bfloat16()
    with torch.inference_mode():
        torch.compile(run, backend="inductor", dynamic=True)(x)
    wt = torch.tensor(w)
    rows = {h: taps.buffers[(1, h)][:9].float() for h in hooks}  # bf16, as captured
    close = {"rtol": 1e-6, "atol": 1e-5}  # float32 sums in another order, no more
    for h in hooks:
        got = t.points[(1, h)].scores[:9, 0]
        assert torch.allclose(got, rows[h] @ wt + 0.5, **close), h
    unrounded = (rows["mlp_out"] + rows["post_attn"]) @ wt + 0.5
    got_post = t.points[(1, "post_block")].scores[:9, 0]
    assert not torch.allclose(got_post, unrounded, **close)  # the rounding mattered here
