"""End to end on the real vLLM engine: capture -> ZeroMQ -> subscribers -> HF oracle.

The oracle tests run once per tiny architecture on a shared engine, for every
hook point; on the Llama engine the same batch is also preempted (tiny KV cache)
and served with prefix caching on. Sink and fault tests run on the Llama engine.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from actbus.streams import point_key
from consumers.fs import ActivationRun
from tests.support.engine import (
    CAPTURE_LAYERS,
    HOOKS,
    MAX_BATCHED_TOKENS,
    SCHED_ARCH,
    preemptions,
)
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.procs import ROOT, manifest, start_sink, stop, wait_for, wait_rows
from tests.support.recorder import RowRecorder

pytestmark = pytest.mark.engine

# Prompt lengths in tokens: several exceed MAX_BATCHED_TOKENS, so chunked prefill splits them.
LENGTHS = [3, 9, 17, 30, 41, 63, 64, 65, 97, 130, 171, 220]


@dataclass
class Req:
    rid: str
    prompt: list[int]
    output: list[int]
    finish_reason: str
    kind: str  # "normal" | "max_tokens_1" | "stop_string" | "empty_output"

    @property
    def fed(self) -> list[int]:
        """Tokens the engine computed: all but the last generated one."""
        return (self.prompt + self.output)[:-1]


def _params(kind: str, vocab: int, stop: str | None = None):
    from vllm import SamplingParams

    if kind == "normal":
        return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    if kind == "long":  # decode growth that the Llama engine's KV cache cannot hold
        return SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    if kind == "max_tokens_1":
        return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if kind == "stop_string":
        return SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, stop=[stop] if stop else None
        )
    if kind == "empty_output":  # every token stops: the output text is empty
        return SamplingParams(temperature=0, max_tokens=16, stop_token_ids=list(range(vocab)))
    raise ValueError(kind)


def _oracle_batch(vocab: int):
    from vllm.inputs import TokensPrompt

    rng = random.Random(1234)
    shared = [rng.randrange(3, vocab) for _ in range(48)]  # prefix-cache hits across prompts
    prompts, kinds = [], []
    for i, n in enumerate(LENGTHS):
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        if i % 2:
            ids = shared[: n // 2] + ids[n // 2 :]
        prompts.append(TokensPrompt(prompt_token_ids=ids))
        kinds.append("long" if i % 3 == 0 else "normal")
    for kind, n in (("max_tokens_1", 70), ("stop_string", 25), ("empty_output", 12)):
        prompts.append(TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(n)]))
        kinds.append(kind)
    return prompts, kinds


@dataclass
class OracleRun:
    reqs: list[Req]
    col: RowRecorder
    model_path: Path
    preemptions: int


@pytest.fixture(scope="session")
def oracle_run(engine) -> OracleRun:
    llm = engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompts, kinds = _oracle_batch(vocab)
    # Probe the same batch once to pick a stop string the greedy output will contain.
    probe = llm.generate(prompts, [_params(k, vocab) for k in kinds], use_tqdm=False)
    text = probe[kinds.index("stop_string")].outputs[0].text
    assert len(text) >= 6, f"probe output too short to pick a stop string from: {text!r}"
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    before = preemptions(llm) if engine.arch == SCHED_ARCH else 0
    col = RowRecorder(engine.address)
    try:
        outs = llm.generate(prompts, [_params(k, vocab, stop_str) for k in kinds], use_tqdm=False)
        reqs = [
            Req(
                o.request_id,
                list(o.prompt_token_ids),
                list(o.outputs[0].token_ids),
                o.outputs[0].finish_reason,
                k,
            )
            for o, k in zip(outs, kinds, strict=True)
        ]
        col.wait_ended([(r.rid, 0) for r in reqs])
    finally:
        col.close()
    after = preemptions(llm) if engine.arch == SCHED_ARCH else 0
    return OracleRun(reqs=reqs, col=col, model_path=engine.model_path, preemptions=after - before)


def test_special_cases_were_exercised(oracle_run, engine):
    by_kind = {r.kind: r for r in oracle_run.reqs}
    assert len(by_kind["max_tokens_1"].output) == 1
    ss = by_kind["stop_string"]
    assert ss.finish_reason == "stop" and len(ss.output) < 16, ss
    eo = by_kind["empty_output"]
    assert eo.finish_reason == "stop" and len(eo.output) == 1, eo
    assert sum(len(r.prompt) > MAX_BATCHED_TOKENS for r in oracle_run.reqs) >= 4
    if engine.arch == SCHED_ARCH:
        assert oracle_run.preemptions > 0, "the tiny KV cache did not force any preemption"


def test_every_position_published_exactly_once(oracle_run):
    col = oracle_run.col
    for layer in CAPTURE_LAYERS:
        for hook in HOOKS:
            for r in oracle_run.reqs:
                positions, token_ids, acts = col.get(r.rid, layer, hook)
                n = len(r.fed)
                where = f"request {r.rid} ({r.kind}) layer {layer} {hook}"
                dup = [p for p, c in Counter(positions.tolist()).items() if c > 1]
                assert not dup, f"{where}: duplicated positions {dup[:10]}"
                # A stop string is detected after the engine may have computed a step or
                # two more; those rows are real and contiguous, never missing in the middle.
                k = len(positions)
                assert positions.tolist() == list(range(k)), f"{where}: gaps in positions"
                if r.kind == "stop_string":
                    assert k >= n
                else:
                    assert k == n, f"{where}: {k} rows, expected {n}"
                assert token_ids[:n].tolist() == r.fed, f"{where}: token ids differ"
                assert acts.shape == (k, engine_hidden(oracle_run))


def engine_hidden(oracle_run) -> int:
    from tests.support.oracle import hf_model

    return hf_model(str(oracle_run.model_path)).config.hidden_size


def test_every_hook_matches_hf_transformers(oracle_run):
    col = oracle_run.col
    worst = {(layer, hook): 0.0 for layer in CAPTURE_LAYERS for hook in HOOKS}
    for r in oracle_run.reqs:
        ref = hf_activations(oracle_run.model_path, r.fed, CAPTURE_LAYERS, HOOKS)
        for key in worst:
            _, _, acts = col.get(r.rid, *key)
            worst[key] = max(worst[key], max_rel_error(acts[: len(r.fed)], ref[key]))
    print(f"max relative error per (layer, hook): {worst}")
    for key, err in worst.items():
        assert err <= 1e-3, f"{key}: max relative error {err:.2e} > 1e-3"


def test_request_ends_carry_the_reason(oracle_run):
    for r in oracle_run.reqs:
        # vLLM's front end finds stop strings and ends such requests by aborting them in
        # the engine, which is all the engine (and so the capture) sees.
        want = "abort" if r.kind == "stop_string" else r.finish_reason
        assert oracle_run.col.ended[(r.rid, 0)] == want, r


def test_batches_mixed_prefill_chunks_and_decode(oracle_run):
    """The oracle is only meaningful if the scheduler really split and mixed batches."""
    prompt_len = {r.rid: len(r.prompt) for r in oracle_run.reqs}
    prefill_steps: dict[str, set[int]] = {}
    step_kinds: dict[int, set[str]] = {}
    for r in oracle_run.reqs:
        rows = oracle_run.col.rows[(r.rid, 0, CAPTURE_LAYERS[0], "post_block")]
        for pos, step in zip(rows.positions, rows.steps, strict=True):
            kind = "prefill" if pos < prompt_len[r.rid] else "decode"
            step_kinds.setdefault(step, set()).add(kind)
            if kind == "prefill":
                prefill_steps.setdefault(r.rid, set()).add(step)
    assert any(len(s) > 1 for s in prefill_steps.values()), "no prompt was split across steps"
    assert any(k == {"prefill", "decode"} for k in step_kinds.values()), "no mixed step"
    assert max(step_kinds) > 10


def test_fs_sink_stores_what_was_published(sched_engine, tmp_path):
    """The sink process, fed by the real engine, stores exactly the published rows."""
    from vllm import SamplingParams

    out = tmp_path / "run"
    sink = start_sink(sched_engine.address, out)
    col = RowRecorder(sched_engine.address)
    try:
        wait_for(lambda: manifest(out), 60, "the sink to subscribe")
        outs = sched_engine.llm.generate(
            ["the residual stream", "quick brown foxes jump over lazy dogs"],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        col.wait_ended([(o.request_id, 0) for o in outs])
        expected = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
        for layer in CAPTURE_LAYERS:
            wait_rows(out, layer, expected)
    finally:
        col.close()
        assert stop(sink) == 0, (out.parent / "run.log").read_text()[-3000:]
    run = ActivationRun(out)
    for o in outs:
        for layer in CAPTURE_LAYERS:
            for hook in HOOKS:
                positions, acts = run.request_rows(o.request_id, layer, hook)
                want_pos, _, want = col.get(o.request_id, layer, hook)
                assert positions.tolist() == want_pos.tolist()
                assert torch.equal(acts, want), (o.request_id, layer, hook)


def test_late_subscriber_receives_later_steps(sched_engine, tmp_path):
    engine = sched_engine
    from vllm import SamplingParams

    out = tmp_path / "late"
    sink = start_sink(engine.address, out)
    try:
        wait_for(lambda: manifest(out), 60, "the late sink to subscribe")
        outs = engine.llm.generate(
            ["the residual stream", "quick brown foxes jump"],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        expected = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
        wait_rows(out, CAPTURE_LAYERS[0], expected)
    finally:
        assert stop(sink) == 0
    run = ActivationRun(out)
    assert run.request_ids(CAPTURE_LAYERS[0]) == sorted(o.request_id for o in outs)
    assert run.manifest["rows"][point_key(CAPTURE_LAYERS[0], "post_block")] == expected


def test_dead_subscribers_do_not_stall_generation(sched_engine, tmp_path):
    """kill -9 of a sink, and of a subscriber that never grants credit, mid-run."""
    engine = sched_engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    keep, doomed = tmp_path / "keep", tmp_path / "doomed"
    sink = start_sink(engine.address, keep)
    victim = start_sink(engine.address, doomed)
    stuck = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "stuck_subscriber.py"), engine.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: manifest(keep) and manifest(doomed), 60, "sinks to subscribe")
        assert stuck.stdout.readline().strip() == "ready"
        rng = random.Random(7)
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, 400) for _ in range(100)])
            for _ in range(16)
        ]
        result: dict[str, object] = {}

        def gen():
            result["outs"] = engine.llm.generate(
                prompts,
                SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                use_tqdm=False,
            )
            result["done"] = time.monotonic()

        t = threading.Thread(target=gen, daemon=True)
        t.start()
        time.sleep(3.0)
        # The stuck subscriber (policy block, no credit) holds generation back by design.
        assert t.is_alive(), "generation finished although a blocking subscriber gave no credit"
        t_kill = time.monotonic()
        victim.kill()
        stuck.kill()
        t.join(timeout=60)
        assert not t.is_alive(), "generation still stalled 60 s after the subscribers died"
        # Death is seen by the socket within a heartbeat, far below the 30 s silence timeout.
        assert result["done"] - t_kill < 10.0, f"resumed {result['done'] - t_kill:.1f}s after kill"
        outs = result["outs"]
        expected = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
        wait_rows(keep, CAPTURE_LAYERS[0], expected)
    finally:
        stuck.kill()
        victim.kill()
        assert stop(sink) == 0
    run = ActivationRun(keep)
    for o in outs:  # the live, lossless sink got everything
        positions, _ = run.request_rows(o.request_id, CAPTURE_LAYERS[0], "post_block")
        assert positions.tolist() == list(range(len(o.prompt_token_ids) + 63))
