"""Live pushes into the shared Llama engine's monitors, over its CURVE control endpoint.

Requests after a push are scored with the pushed weights (checked against HF
transformers' hidden states) and carry its version; versions increase; a probe pushed
through the trainers' fold scores as its checkpoint does; bad pushes and
unauthenticated peers are refused, naming the field, and the old version stays; and
nothing is recompiled. Runs after tests/monitor/test_monitor_engine.py (which checks
version 1) and puts the original weights back.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from actbus.bus.control import ControlClient, PushRefused
from tests.monitor.test_monitor_engine import REL_TOL, ScoreLog, _params
from tests.support.compile_counts import compile_counts
from tests.support.monitors import SPECS, expected_scores
from tests.support.oracle import hf_activations

pytestmark = pytest.mark.engine

SPEC = {s.name: s for s in SPECS}


def _client(engine, **kw) -> ControlClient:
    c = engine.control
    return ControlClient(
        c["address"],
        server_key=kw.get("server_key", c["server_key"]),
        client_secret_key=kw.get("client_secret_key", c["client_secret_key"]),
        timeout_s=kw.get("timeout_s", 30),
    )


def _scored(engine, monitor: str, seed: int, max_tokens: int = 4):
    """One request monitored by ``monitor``: (tokens fed, its layer's HF stream, scores
    [tokens, width] by position, the versions they carry)."""
    from vllm.inputs import TokensPrompt

    llm = engine.llm
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, llm.get_tokenizer().vocab_size, 11).tolist()
    log = ScoreLog(engine.address, monitors=(monitor,))
    try:
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)],
            [_params([monitor], max_tokens=max_tokens)],
            use_tqdm=False,
        )[0]
        log.wait_ended([(out.request_id, 0)])
    finally:
        log.close()
    spec = SPEC[monitor]
    fed = (prompt + list(out.outputs[0].token_ids))[:-1]
    rows = sorted(log.rows[(out.request_id, 0, monitor, spec.layers[0])], key=lambda r: r[0])
    assert [r[0] for r in rows] == list(range(len(fed))), [r[0] for r in rows]
    acts = hf_activations(engine.model_path, fed, [spec.layers[0]], [spec.hook])
    got = torch.from_numpy(np.stack([r[2] for r in rows]))
    return acts[(spec.layers[0], spec.hook)].float(), got, {r[3] for r in rows}


def _close(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    return float(((got - ref).norm(dim=-1) / scale.clamp_min(1e-12)).max())


def test_pushed_weights_score_later_requests_with_their_version(sched_engine):
    raw = sched_engine.monitor["monitors"]["raw"]
    hidden = len(raw["weight"])
    before = sched_engine.llm.collective_rpc(compile_counts)
    assert before[0]["dynamo_graphs"] > 0, before
    gen = torch.Generator().manual_seed(3)
    with _client(sched_engine) as c:
        start = c.status()["monitors"]["raw"]["version"]
        versions = []
        try:
            for i in range(2):
                w = torch.randn(hidden, generator=gen) / hidden**0.5
                b = float(torch.randn((), generator=gen))
                versions.append(c.push("raw", w.numpy(), [b])["version"])
                x, got, seen = _scored(sched_engine, "raw", seed=40 + i)
                assert seen == {versions[-1]}, (seen, versions)
                ref = (x @ w + b)[:, None]
                scale = w.norm() * x.norm(dim=-1) + abs(b)
                assert _close(got, ref, scale) <= REL_TOL
            assert versions == [start + 1, start + 2]
            st = c.status()
        finally:  # the engine's own weights back, for the tests after these
            c.push("raw", np.asarray(raw["weight"], dtype=np.float32), [raw["bias"]])
    assert st["monitors"]["raw"] == {"version": start + 2, "in_use": start + 2}
    swaps = [s for s in st["swaps"] if s.get("monitor") == "raw"][-2:]
    assert [s["version"] for s in swaps] == versions
    assert all(0 <= s["swap_ms"] < 30_000 and s["scheduled"] >= s["received"] for s in swaps)
    after = sched_engine.llm.collective_rpc(compile_counts)
    assert before == after, (before, after)


def test_a_probe_pushed_through_the_trainers_fold_scores_as_its_checkpoint(sched_engine):
    from trainers.checkpoint import load_probe
    from trainers.push import PushTarget, folded

    src = sched_engine.monitor["monitors"]["probe"]
    target = PushTarget("probe", "probe", "probe")
    flipped = load_probe(src["probe"])
    with torch.no_grad():  # negated logits: every probability p becomes 1 - p
        flipped.linear.weight.neg_()
        flipped.linear.bias.neg_()
    with _client(sched_engine) as c:
        for probe, seed, flip in ((flipped, 50, True), (load_probe(src["probe"]), 51, False)):
            mw = folded(probe, target)
            version = c.push("probe", mw.weight, mw.bias)["version"]
            x, got, seen = _scored(sched_engine, "probe", seed=seed)
            assert seen == {version}
            ref = expected_scores(SPEC["probe"], src, x)
            ref = 1 - ref if flip else ref
            assert _close(got, ref, ref.norm(dim=-1)) <= REL_TOL, flip


def test_bad_pushes_and_strangers_are_refused_and_the_old_version_stays(sched_engine, tmp_path):
    from actbus.bus.security import generate_keys

    raw = sched_engine.monitor["monitors"]["raw"]
    w = np.asarray(raw["weight"], dtype=np.float32)
    with _client(sched_engine) as c:
        version = c.status()["monitors"]["raw"]["version"]
        bad = [
            (("raw", w[:-1], [0.0]), "weight", f"shape [1, {len(w) - 1}] does not fit"),
            (("raw", np.where(np.arange(len(w)) == 3, np.nan, w), [0.0]), "weight", "NaN or Inf"),
            (("raw", w, [np.inf]), "bias", "NaN or Inf"),
            (("toxic", w, [0.0]), "monitor", "no monitor named 'toxic' on this engine"),
            (("raw", w, [0.0], None, version), "version", f"{version} is not above"),
            (("sae_jump", np.ones((3, len(w))), [0, 0, 0]), "frames", "weight, bias and thresh"),
        ]
        for args, field, msg in bad:
            with pytest.raises(PushRefused, match=re.escape(msg)) as e:
                c.push(*args)
            assert e.value.field == field, (field, str(e.value))
    stranger = generate_keys(tmp_path / "keys", client="stranger")
    for kw, why in (
        ({"server_key": None, "client_secret_key": None, "timeout_s": 5}, "CURVE|control"),
        ({"client_secret_key": str(stranger.client_secret)}, "refused this subscriber's CURVE"),
    ):
        with _client(sched_engine, **kw) as c, pytest.raises((PermissionError, TimeoutError)) as e:
            c.push("raw", w * 0, [5.0])
        assert re.search(why, str(e.value)), str(e.value)
    with _client(sched_engine) as c:
        st = c.status()
    assert st["monitors"]["raw"] == {"version": version, "in_use": version}
    x, got, seen = _scored(sched_engine, "raw", seed=60, max_tokens=2)
    assert seen == {version}
    ref = (x @ torch.from_numpy(w) + raw["bias"])[:, None]
    assert (
        _close(got, ref, torch.from_numpy(w).norm() * x.norm(dim=-1) + abs(raw["bias"])) <= REL_TOL
    )


def test_pushes_while_requests_run_flip_every_step_whole(sched_engine):
    """A pusher thread pushes new probe weights every few milliseconds while a batch
    generates. The probe is evaluated at two layers, so a step that saw half a swap
    would show it: the scores of one position, at both layers, must come from one
    version (the one they carry), and each must equal that version's weights applied
    to HF transformers' hidden states; versions never go back along a request."""
    import threading

    from vllm.inputs import TokensPrompt

    from trainers.checkpoint import load_probe
    from trainers.push import PushTarget, folded

    spec = SPEC["probe"]
    src = sched_engine.monitor["monitors"]["probe"]
    llm = sched_engine.llm
    rng = np.random.default_rng(70)
    prompts = [rng.integers(3, 400, 9 + i).tolist() for i in range(6)]
    first = hf_activations(sched_engine.model_path, prompts[0], [spec.layers[0]], [spec.hook])
    x0 = first[(spec.layers[0], spec.hook)].float()
    hidden, typical = x0.shape[1], float(x0.norm(dim=-1).mean())
    pushed: dict[int, tuple[torch.Tensor, float]] = {}
    stop = threading.Event()
    errors: list[BaseException] = []

    def pusher() -> None:
        gen = torch.Generator().manual_seed(11)
        try:
            with _client(sched_engine) as c:
                i = 0
                while not stop.is_set():
                    w = torch.randn(hidden, generator=gen) / typical  # w.x ~ N(0, 1)
                    b = 1.5 if i % 2 else -1.5  # far apart: a mixed-up version shows
                    v = c.push("probe", w.numpy(), [b])["version"]
                    pushed[v] = (w, b)
                    i += 1
                    stop.wait(0.01)
        except BaseException as e:
            errors.append(e)

    with _client(sched_engine) as c:
        start = c.status()["monitors"]["probe"]["version"]
    log = ScoreLog(sched_engine.address, monitors=("probe",))
    thread = threading.Thread(target=pusher, daemon=True)
    thread.start()
    try:
        while not pushed:
            time.sleep(0.01)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [_params(["probe"], max_tokens=24)] * len(prompts),
            use_tqdm=False,
        )
        stop.set()
        thread.join(timeout=30)
        log.wait_ended([(o.request_id, 0) for o in outs])
    finally:
        stop.set()
        log.close()
        with _client(sched_engine) as c:  # the engine's own probe back
            mw = folded(load_probe(src["probe"]), PushTarget("probe", "probe", "probe"))
            c.push("probe", mw.weight, mw.bias)
    assert not errors, errors
    seen: set[int] = set()
    for o, prompt in zip(outs, prompts, strict=True):
        fed = (prompt + list(o.outputs[0].token_ids))[:-1]
        acts = hf_activations(sched_engine.model_path, fed, list(spec.layers), [spec.hook])
        by_layer = {}
        for layer in spec.layers:
            rows = sorted(log.rows[(o.request_id, 0, "probe", layer)], key=lambda r: r[0])
            assert [r[0] for r in rows] == list(range(len(fed))), (layer, [r[0] for r in rows])
            by_layer[layer] = rows
        versions = [r[3] for r in by_layer[spec.layers[0]]]
        assert versions == [r[3] for r in by_layer[spec.layers[1]]]  # one step, one version
        assert versions == sorted(versions), versions
        assert all(v > start and v in pushed for v in versions), (start, sorted(pushed)[:5])
        seen.update(versions)
        for layer, rows in by_layer.items():
            x = acts[(layer, spec.hook)].float()
            for (pos, _tok, got, v), xi in zip(rows, x, strict=True):
                w, b = pushed[v]
                ref = torch.sigmoid(xi @ w + b)
                assert abs(float(got[0]) - float(ref)) <= REL_TOL * float(ref), (pos, layer, v)
    assert len(seen) >= 3, sorted(seen)  # swaps landed while the batch generated
