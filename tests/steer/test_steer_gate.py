"""Gated steering in the compiled graph (inductor, dynamic shapes), no engine: each
gate kind and source against eager math, closed gates bitwise untouched, the previous
token's score carried across steps, and no recompilation when gates change."""

import numpy as np
import pytest
import torch

from actbus.engine.layers import find_decoder_layers, wrap_layer
from actbus.monitor.graph import install_monitors
from actbus.monitor.weights import MonitorWeights
from actbus.steer.graph import install_gates, install_steering
from actbus.steer.worker import Steerer
from actbus.steps import StepRequests
from tests.steer.test_steer_graph import N_LAYERS, AddNorm, D, K, Model, _wire

# Monitors: "early" at layer 0 post_block (before layers 1 and 2), "late" at layer 2
# post_attn (after layer 0's points).
MONITORS = {"early": (0, "post_block"), "late": (2, "post_attn")}


def _build():
    torch.manual_seed(0)
    model = Model()
    decoder = find_decoder_layers(model, N_LAYERS)
    cpu = torch.device("cpu")
    tables = install_steering(
        decoder,
        layers=(0, 1, 2),
        hooks=("pre_attn", "post_attn", "post_block"),
        hidden_size=D,
        max_rows=64,
        per_token=K,
        max_vectors=8,
        dtype=torch.float32,
        device=cpu,
    )
    g = torch.Generator().manual_seed(1)
    w = {n: torch.randn(1, D, generator=g) / D**0.5 for n in MONITORS}
    weights = {
        n: MonitorWeights(
            w[n].numpy(), np.zeros(1, np.float32), "linear", np.zeros(1, np.float32), published=(0,)
        )
        for n in MONITORS
    }
    mon = install_monitors(
        decoder,
        weights,
        {n: [p] for n, p in MONITORS.items()},
        hidden_size=D,
        max_rows=64,
        device=cpu,
    )
    gates = install_gates(decoder, tables, {p: t.scores for p, t in mon.points.items()}, slots=5)
    for layer in decoder:
        wrap_layer(layer)
    columns = {
        (n, p[0]): (gates.monitor_points.index(p), {-1: mon.points[p].segments[n].lo})
        for n, p in MONITORS.items()
    }
    return model, Steerer(tables, gates, columns), w


def reference(model, x, adds, w):
    """Eager forward; ``adds[(layer, hook)](stream, scores) -> delta`` where ``scores``
    holds the monitors' scores read so far in this forward."""
    scores: dict[str, torch.Tensor] = {}
    residual, h = None, x

    def at(i, hook, stream):
        f = adds.get((i, hook))
        if f is not None:
            stream = stream + f(stream, scores)
        for n, p in MONITORS.items():
            if p == (i, hook):
                scores[n] = (stream @ w[n].T)[:, 0]
        return stream

    for i, layer in enumerate(model.model.layers):
        stream = at(i, "pre_attn", h if residual is None else h + residual)
        residual = stream
        a, _ = AddNorm()(stream)
        stream = at(i, "post_attn", torch.tanh(layer.attn(a)) + residual)
        residual = stream
        m, _ = AddNorm()(stream)
        h = torch.tanh(layer.mlp(m))
        stream = at(i, "post_block", h + residual)
        residual, h = stream, torch.zeros_like(stream)
    return h + residual, scores


def test_gates_match_eager_and_leave_closed_tokens_bitwise_alone():
    model, steerer, w = _build()
    explain = torch._dynamo.explain(model)(torch.arange(5), torch.randn(5, D))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", dynamic=True)
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(2)
    v = {f"d{i}": torch.randn(D, generator=g) for i in range(3)}

    def step(rid, x, start, prompt_len, entries=None, new=True):
        sr = StepRequests([(rid, prompt_len, _wire(v, entries))] if new else [], {}, set(), {})
        steerer.admit(sr)
        steerer.fill([rid], np.array([0, len(x)]), {rid: start})
        with torch.inference_mode():
            return compiled(torch.arange(len(x)), x)

    def end(rid):
        steerer.admit(StepRequests([], {}, {rid}, {}))

    # 1: same-token hard gate at layer 1 post_block on "early" (layer 0 post_block);
    # the same batch unsteered first, to compare closed rows bit for bit.
    x = torch.randn(24, D, generator=g)
    plain = step("p", x, 0, 24, [])
    end("p")
    gate = ["early", 0, "post_block", -1, 0.05, 0.0, "token"]
    got = step("a", x, 0, 24, [[1, "post_block", "d0", 3.0, 0.0, "base", "all", gate]])
    end("a")

    def hard(s, sc):
        return 3.0 * (sc["early"] > 0.05).float()[:, None] * v["d0"]

    want, sc = reference(model, x, {(1, "post_block"): hard}, w)
    torch.testing.assert_close(got, want)
    is_open = sc["early"] > 0.05
    assert 3 <= int(is_open.sum()) <= 21, "the gate should split the tokens"
    assert torch.equal(got[~is_open], plain[~is_open])  # closed: bitwise the unsteered run
    assert not torch.equal(got[is_open], plain[is_open])

    # 2: same-token sigmoid gate, norm-matched, next to an ungated vector at one point
    gate = ["early", 0, "post_block", -1, 0.0, -4.0, "token"]
    b = 0.5 / float(v["d1"].norm())
    entries = [
        [2, "pre_attn", "d1", 0.0, b, "base", "all", gate],
        [2, "pre_attn", "d2", 1.0, 0.0, "base", "all"],
    ]
    x = torch.randn(9, D, generator=g)
    got = step("b", x, 0, 9, entries)
    end("b")

    def soft(s, sc):
        gv = torch.sigmoid(-4.0 * sc["early"])[:, None]
        return gv * 0.5 * s.norm(dim=-1, keepdim=True) * v["d1"] / v["d1"].norm() + v["d2"]

    torch.testing.assert_close(got, reference(model, x, {(2, "pre_attn"): soft}, w)[0])

    # 3: previous-token gates over a chunked prompt and decode steps: one on "early"
    # (scored before layer 2 post_attn: within a step, the row before), one on "late"
    # (scored after layer 0 post_block: closed on prompt tokens, then carried).
    prev_early = ["early", 0, "post_block", -1, -0.4, 0.0, "previous"]
    prev_late = ["late", 2, "post_attn", -1, 0.0, 3.0, "previous"]
    entries = [
        [2, "post_attn", "d0", 2.0, 0.0, "base", "all", prev_early],
        [0, "post_block", "d1", 2.5, 0.0, "base", "all", prev_late],
    ]
    prompt_len, seen = 7, {"early": [], "late": []}

    def prev_adds(first):
        def early(s, sc):  # this step's scores are in: "early" ran before this point
            pos = torch.arange(first, first + s.shape[0])
            hist = torch.cat([*seen["early"], sc["early"]])  # positions 0..
            open_ = (hist[(pos - 1).clamp(min=0)] > -0.4) & (pos > 0)
            return 2.0 * open_.float()[:, None] * v["d0"]

        def late(s, sc):  # "late" has not run yet in this forward
            pos = torch.arange(first, first + s.shape[0])
            if first < prompt_len:
                assert bool((pos < prompt_len).all())
                return torch.zeros_like(s)  # prompt tokens: closed
            score = torch.cat(seen["late"])[pos - 1]
            return 2.5 * torch.sigmoid(3.0 * score)[:, None] * v["d1"]

        return {(2, "post_attn"): early, (0, "post_block"): late}

    chunks = [(0, 4), (4, 3), (7, 1), (8, 1), (9, 1)]  # (first position, tokens)
    for j, (first, n) in enumerate(chunks):
        if first == prompt_len:  # new gates and tables never recompiled (n=1 may: size 1)
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            assert frames == 1, f"gates recompiled: {frames} graphs"
        x = torch.randn(n, D, generator=g)
        got = step("c", x, first, prompt_len, entries, new=j == 0)
        want, sc = reference(model, x, prev_adds(first), w)
        torch.testing.assert_close(got, want, msg=f"step {j} at position {first}")
        for name in seen:
            seen[name].append(sc[name])
    end("c")
    # The carried gates did something: the decode steps' late gate is not ~0.
    late = torch.sigmoid(3.0 * torch.cat(seen["late"])[6:9])
    assert bool((late > 0.01).all())
    assert steerer.gates is not None and len(steerer._gate_free) == 4  # the slot is back


# ---------------------------------------------------------------- config, no graph
def _frontend(monitors=True, stages=None):
    from actbus.monitor.config import MonitorConfig
    from actbus.steer.config import SteerConfig
    from actbus.steer.frontend import SteerFrontend

    w = [0.5, -0.25, 0.0, 1.0]
    mcfg = MonitorConfig.from_dict(
        {
            "monitors": {
                "p": {"weight": w, "layers": [1]},  # post_block
                "two": {"weight": w, "layers": [0, 2], "hook": "pre_attn"},
                "sae": {"sae": "runs/x", "features": [3, 17], "layers": [1], "hook": "mlp_out"},
            }
        }
    )
    steer = SteerConfig.from_dict({"hooks": ["pre_attn", "post_attn", "post_block"]})
    fe = SteerFrontend(
        steer, num_layers=4, hidden_size=4, monitors=mcfg if monitors else None, stages=stages
    )
    fe.registry.register("v", np.ones(4))
    return fe


GOOD = [
    (
        {"monitor": "p", "threshold": 0.5},
        2,
        "pre_attn",
        ("p", 1, "post_block", -1, 0.5, 0.0, "token"),
    ),
    (
        {"monitor": "two", "layer": 0, "threshold": -1, "sharpness": 4, "source": "token"},
        0,
        "post_attn",
        ("two", 0, "pre_attn", -1, -1.0, 4.0, "token"),
    ),
    (  # the previous token's score may come from a later point
        {"monitor": "sae", "feature": 17, "threshold": 0.0, "source": "previous"},
        0,
        "pre_attn",
        ("sae", 1, "mlp_out", 17, 0.0, 0.0, "previous"),
    ),
    (  # mlp_out is scored before post_block steering of the same layer
        {"monitor": "sae", "feature": 3, "threshold": 1.0},
        1,
        "post_block",
        ("sae", 1, "mlp_out", 3, 1.0, 0.0, "token"),
    ),
]


def test_gates_resolve_against_the_engines_monitors():
    fe = _frontend()
    for gate, layer, hook, want in GOOD:
        rs = fe.request([{"vector": "v", "layers": layer, "hooks": hook, "gate": gate}], True, "s")
        assert rs is not None and rs.entries[0].gate == want
        assert rs.to_wire()["entries"][0][7] == list(want)


BAD = [
    ("on", "steer[0].gate: expected a mapping"),
    ({"monitor": "p"}, "steer[0].gate.threshold: required"),
    ({"threshold": 1}, "steer[0].gate.monitor: required"),
    ({"monitor": "p", "threshold": 1, "column": 0}, "steer[0].gate.column: unknown key"),
    ({"monitor": "p", "threshold": float("nan")}, "steer[0].gate.threshold: expected a threshold"),
    ({"monitor": "p", "threshold": 1, "sharpness": 0}, "steer[0].gate.sharpness: 0 makes"),
    ({"monitor": "p", "threshold": 1, "source": "next"}, "steer[0].gate.source: expected 'token'"),
    ({"monitor": "p", "threshold": 1, "layer": -1}, "steer[0].gate.layer: expected an int >= 0"),
    ({"monitor": "q", "threshold": 1}, "steer[0].gate.monitor: no monitor named 'q'"),
    ({"monitor": "two", "threshold": 1}, "steer[0].gate.layer: required: monitor 'two'"),
    (
        {"monitor": "two", "layer": 1, "threshold": 1},
        "not evaluated at layer 1 (its layers: [0, 2])",
    ),
    ({"monitor": "sae", "threshold": 1}, "steer[0].gate.feature: monitor 'sae' scores several"),
    ({"monitor": "sae", "feature": 5, "threshold": 1}, "features [3, 17] (got 5)"),
    (
        {"monitor": "p", "feature": 0, "threshold": 1},
        "steer[0].gate.feature: monitor 'p' is a weight",
    ),
    (  # same point: the monitor reads the steered stream, after it
        {"monitor": "two", "layer": 2, "threshold": 1},
        "steer[0].gate.source: 'token' reads this token's score, but monitor 'two' at layer 2 "
        "pre_attn is scored after the steered point (layer 2 pre_attn)",
    ),
]


@pytest.mark.parametrize("gate,needle", BAD)
def test_bad_gates_name_the_field_and_the_fix(gate, needle):
    from actbus.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _frontend().request(
            [{"vector": "v", "layers": 2, "hooks": "pre_attn", "gate": gate}], True, "steer"
        )
    assert needle in str(e.value), str(e.value)


def test_under_pipeline_parallelism_a_gate_reads_a_monitor_on_its_own_stage():
    """A later stage never computes an earlier stage's monitors, so a gate across stages
    would read a buffer nothing writes (seen on 2 GPUs at PP=2: steered rows 0.6-1.2
    off HF): refused by name, for the token's score and the previous token's alike."""
    from actbus.errors import ConfigError

    fe = _frontend(stages=(0, 0, 1, 1))  # monitor 'p' at layer 1: stage 0
    for source in ("token", "previous"):
        gate = {"monitor": "p", "threshold": 0.5, "source": source}
        with pytest.raises(ConfigError) as e:
            fe.request([{"vector": "v", "layers": 2, "hooks": "pre_attn", "gate": gate}], True, "s")
        assert str(e.value).startswith("s[0].gate.layer: monitor 'p' at layer 1 is scored on ")
        assert "pipeline stage 0, but the steered layer 2 runs on stage 1" in str(e.value)
    # the same stage, and a one-stage engine, as before
    assert fe.request([{"vector": "v", "layers": 1, "gate": gate}], True, "s") is not None
    gate = {"monitor": "p", "threshold": 0.5}
    assert _frontend().request([{"vector": "v", "layers": 2, "gate": gate}], True, "s")


def test_pipeline_stages_follow_vllms_partition(monkeypatch):
    from types import SimpleNamespace

    from actbus.engine.session import pipeline_stages

    def config(layers, pp):
        mc = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=layers))
        return SimpleNamespace(
            model_config=mc, parallel_config=SimpleNamespace(pipeline_parallel_size=pp)
        )

    assert pipeline_stages(config(4, 1)) is None
    assert pipeline_stages(config(4, 2)) == (0, 0, 1, 1)
    assert pipeline_stages(config(5, 2)) == (0, 0, 0, 1, 1)  # vLLM: the last stage lighter
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert pipeline_stages(config(4, 2)) == (0, 1, 1, 1)


def test_a_gate_needs_monitors_and_salts_the_steered_blocks():
    from actbus.errors import ConfigError

    entry = {"vector": "v", "layers": 2, "gate": {"monitor": "p", "threshold": 0.5}}
    with pytest.raises(ConfigError, match=r"steer\[0\]\.gate\.monitor: .*none configured"):
        _frontend(monitors=False).request([entry], True, "steer")
    fe = _frontend()

    def salt(e):
        return fe.request([e], True, "steer").kv_salt(10)

    plain = {k: v for k, v in entry.items() if k != "gate"}
    assert salt(entry) is not None and salt(entry) != salt(plain)
    assert salt(entry) != salt({**entry, "gate": {"monitor": "p", "threshold": 0.6}})
    assert salt({**entry, "tier": "decode"})[0] == 10
    # the engine's global entries take gates too
    fe.set_global([entry])
    assert fe.global_entries[0].gate is not None
