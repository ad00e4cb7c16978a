"""Numbers a client sends, checked against the type they become (issue 33): positions
against the wire's int32 and the model's max_model_len, scales, thresholds, sharpness,
weights and vector components against float32; and the steering op's result kept
finite and bounded whatever finite float32 coefficients it is given. No engine."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from actbus.capture.selection import parse_selection
from actbus.config import CaptureConfig
from actbus.engine.layers import find_decoder_layers, wrap_layer
from actbus.errors import ConfigError
from actbus.monitor.config import MonitorConfig
from actbus.steer.config import FLOAT32_MAX, SteerConfig, parse_steer
from actbus.steer.frontend import SteerFrontend
from actbus.steer.graph import STREAM_BOUND, bounded_add, install_steering, stream_bound
from actbus.steer.worker import Steerer
from actbus.steps import StepRequests
from actbus.streams import MAX_INT32, parse_positions
from actbus.wire import MAX_INT32 as WIRE_INT32
from tests.steer.test_steer_graph import N_LAYERS, D, Model, _wire

H = 8
HUGE = 9223372036854775808  # 2**63: the position that killed the engine


def test_positions_fit_int32_and_the_model():
    assert MAX_INT32 == WIRE_INT32 == 2**31 - 1
    assert parse_positions([MAX_INT32, 0], "p") == (0, MAX_INT32)
    for raw in ([HUGE], HUGE, [2**31], [1, 10**5000]):
        with pytest.raises(ConfigError, match=r"p\[\d\]: .*(int32|bits)"):
            parse_positions(raw, "p")
    assert parse_positions([511], "p", max_len=512) == (511,)
    with pytest.raises(ConfigError, match=r"p\[1\]: position 512 is past .*max_model_len 512"):
        parse_positions([3, 512], "p", max_len=512)
    assert parse_positions("all", "p", max_len=1) == "all"


def test_selection_and_steering_positions_are_bounded_by_name():
    sel = {"positions": [HUGE]}
    kw = {"engine_layers": (0,), "engine_hooks": ("post_block",), "num_layers": 2}
    with pytest.raises(ConfigError, match=r"extra_args.actbus.positions\[0\]: .*int32"):
        parse_selection(sel, **kw)
    with pytest.raises(ConfigError, match=r"extra_args.actbus.positions\[0\]: .*max_model_len"):
        parse_selection({"positions": [600]}, max_len=512, **kw)
    entry = {"vector": "v", "layers": 1, "positions": [HUGE]}
    with pytest.raises(ConfigError, match=r"s\[0\].positions\[0\]: .*int32"):
        parse_steer([entry], "s")
    fe = SteerFrontend(SteerConfig(), num_layers=2, hidden_size=H, max_len=512)
    with pytest.raises(ConfigError, match=r"actbus.steer.global\[0\].positions\[0\]"):
        fe.set_global([{**entry, "vector": [1.0] * H, "positions": [512]}])
    with pytest.raises(ConfigError, match=r"extra_args.actbus.steer\[0\].positions\[0\]"):
        fe.request([{**entry, "vector": [1.0] * H}], True, "extra_args.actbus.steer")
    assert fe.global_entries == ()


@pytest.mark.parametrize("bad", [1e39, -1e300, 10**400, 2 * FLOAT32_MAX])
def test_steering_numbers_are_finite_as_float32(bad):
    def entry(**kw):
        return [{"vector": "v", "layers": 1, **kw}]

    cases = [
        (entry(scale=bad), r"s\[0\].scale: expected a scale \(a number finite as float32"),
        (entry(gate={"monitor": "m", "threshold": bad}), r"s\[0\].gate.threshold"),
        (entry(gate={"monitor": "m", "threshold": 0, "sharpness": bad}), r"gate.sharpness"),
        ([{"vector": [0.0, bad, 1.0], "layers": 1}], r"s\[0\].vector\[1\]: expected a vector"),
    ]
    for raw, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            parse_steer(raw, "s")
    assert parse_steer(entry(scale=FLOAT32_MAX), "s")[0].scale == FLOAT32_MAX
    weight = {"weight": [0.0, bad], "layers": [0]}
    with pytest.raises(ConfigError, match=r"monitors.a.weight\[1\]"):
        MonitorConfig.from_dict({"monitors": {"a": weight}})
    with pytest.raises(ConfigError, match=r"monitors.a.bias"):
        MonitorConfig.from_dict({"monitors": {"a": {"weight": [1.0], "layers": [0], "bias": bad}}})


def test_norm_matched_coefficient_must_fit_float32():
    fe = SteerFrontend(SteerConfig(), num_layers=2, hidden_size=H)
    tiny = [1e-30] + [0.0] * (H - 1)
    with pytest.raises(ConfigError, match=r"x\[0\].scale: .*past float32's range"):
        fe.request([{"vector": tiny, "layers": 1, "norm_match": True, "scale": 1e10}], True, "x")
    fe.request([{"vector": tiny, "layers": 1, "scale": FLOAT32_MAX}], True, "x")  # plain: a


def test_engine_config_positions_are_bounded():
    with pytest.raises(ConfigError, match=r"actbus.positions\[0\]: .*int32"):
        CaptureConfig.from_dict({"layers": [0], "positions": [HUGE]})


def test_bounded_add_keeps_steered_rows_finite_and_others_bitwise():
    lim = stream_bound(torch.float32)
    assert lim == STREAM_BOUND and stream_bound(torch.float16) < 65504 / 2
    inf, nan = float("inf"), float("nan")
    target = torch.tensor([[1.0, -2.0, 3.0, 4.0, 5.0], [-0.0, 7.0, inf, nan, 9.0]])
    delta = torch.tensor([[inf, -inf, nan, 1e38, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    touched = torch.tensor([[True], [False]])
    got = bounded_add(target, delta, touched)
    assert torch.equal(got[0], torch.tensor([lim, -lim, 3.0, lim, 5.5]))
    assert got[1, 0].item() == 0.0 and torch.signbit(got[1, 0])  # -0.0 kept
    assert torch.equal(got[1, :3], target[1, :3]) and got[1, 3].isnan()  # untouched: as was
    half = bounded_add(target.half(), delta, touched)
    assert torch.isfinite(half[0]).all() and half[0, 0] == stream_bound(torch.float16)


def test_extreme_coefficients_in_the_compiled_graph_stay_finite():
    """The steering op under Inductor: a = FLOAT32_MAX times a vector of extreme
    components, plus a norm-matched b past any stream's norm (inf * 0 is NaN in the
    sum), stays finite and bounded in its own token; the other tokens are bitwise what
    they are unsteered; nothing recompiles between the plain and the extreme values."""
    torch.manual_seed(0)
    model = Model()
    decoder = find_decoder_layers(model, N_LAYERS)
    tables = install_steering(
        decoder,
        layers=(0, 1),
        hooks=("pre_attn", "post_block"),
        hidden_size=D,
        max_rows=16,
        per_token=2,
        max_vectors=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for i in (0, 1):
        wrap_layer(decoder[i])
    steerer = Steerer(tables)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", dynamic=True)
    torch._dynamo.utils.counters.clear()
    big = np.zeros(D, np.float32)
    big[:4] = [FLOAT32_MAX, -FLOAT32_MAX, 1.0, 1e-30]
    vecs = {"big": big, "one": np.ones(D, np.float32)}
    x = torch.randn(6, D)

    def run(entries):
        sr = StepRequests([("r", 6, _wire(vecs, entries))], {"r": 0}, set(), {})
        steerer.admit(sr)
        steerer.fill(["r"], np.array([0, 6]), {"r": 0})
        with torch.inference_mode():
            out = compiled(torch.arange(6), x)
        steerer.admit(StepRequests([], {}, {"r"}, {}))
        return out

    plain = run([[0, "pre_attn", "one", 0.0, 0.0, "base", [2]]])  # coefficient 0: unsteered
    extreme = run(
        [
            [0, "pre_attn", "big", FLOAT32_MAX, FLOAT32_MAX, "base", [2]],
            [0, "pre_attn", "one", FLOAT32_MAX, 0.0, "base", [2]],
            [1, "post_block", "big", -FLOAT32_MAX, 0.0, "base", [2, 4]],
        ]
    )
    assert torch.isfinite(extreme).all(), extreme
    assert extreme.abs().max() <= 2 * STREAM_BOUND
    rest = [0, 1, 3, 5]
    assert torch.equal(extreme[rest], plain[rest])
    assert not torch.equal(extreme[2], plain[2]) and not torch.equal(extreme[4], plain[4])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_live_norm_matched_coefficient_stays_within_float32():
    """A live vector's norm is known only in the worker: a norm-matched scale divided
    by a tiny norm is held at float32's largest, not inf."""
    from actbus.steer.graph import SteerTables
    from actbus.steer.live import LiveVectors

    tables = SteerTables(
        torch.zeros(3, 4), {(1, "post_block"): torch.zeros(8, 1, dtype=torch.int64)},
        {(1, "post_block"): torch.zeros(8, 1, 2)}, per_token=1, max_rows=8,
    )  # fmt: skip
    tiny = np.array([1e-30, 0, 0, 0], np.float32)
    st = Steerer(tables, live=LiveVectors({"dir": tiny}, 4))
    entry = [1, "post_block", "live:dir", 0.0, -FLOAT32_MAX, "base", "all"]
    st.admit(
        StepRequests([("r", 4, {"steer": {"vectors": {}, "entries": [entry]}})], {}, set(), {})
    )
    assert st._reqs["r"].b[0] == np.float32(-FLOAT32_MAX)


def test_registered_values_are_checked_per_component():
    """``PUT /v1/actbus/vectors/NAME`` and ``vectors(llm).register`` with a list: a value
    past float32 (or past float64: an OverflowError, HTTP 500, before) is named."""
    from actbus.steer.vectors import VectorRegistry

    reg = VectorRegistry(3)
    for bad, shown in ((1e39, "1e+39"), (10**400, "an integer of 1329 bits")):
        with pytest.raises(ConfigError, match=rf"vectors.v\[1\]: .*got {re.escape(shown)}"):
            reg.register("v", [0.0, bad, 1.0])
    assert reg.register("v", [0.0, FLOAT32_MAX, 1.0]).values[1] == np.float32(FLOAT32_MAX)
