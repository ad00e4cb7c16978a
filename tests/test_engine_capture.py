"""End to end on the real vLLM engine: capture -> ZeroMQ -> fs-sink process -> HF oracle.

Every test here runs once per tiny architecture (Llama, Qwen2) on a shared engine.
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

import pyarrow.compute as pc
import pytest

from consumers.fs import ActivationRun
from tests.conftest import CAPTURE_LAYERS, MAX_BATCHED_TOKENS, ROOT
from tests.oracle import hf_post_block, max_rel_error
from tests.procs import manifest, start_sink, stop, wait_for, wait_rows

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
    if kind == "long":
        return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
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
    prompts, kinds = [], []
    for i, n in enumerate(LENGTHS):
        prompts.append(TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(n)]))
        kinds.append("long" if i % 3 == 0 else "normal")
    for kind, n in (("max_tokens_1", 70), ("stop_string", 25), ("empty_output", 12)):
        prompts.append(TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(n)]))
        kinds.append(kind)
    return prompts, kinds


@dataclass
class OracleRun:
    reqs: list[Req]
    run: ActivationRun
    model_path: Path


@pytest.fixture(scope="session")
def oracle_run(engine, tmp_path_factory) -> OracleRun:
    llm = engine.llm
    vocab = llm.get_tokenizer().vocab_size
    prompts, kinds = _oracle_batch(vocab)
    # Probe the same batch once to pick a stop string the greedy output will contain.
    probe = llm.generate(prompts, [_params(k, vocab) for k in kinds], use_tqdm=False)
    text = probe[kinds.index("stop_string")].outputs[0].text
    assert len(text) >= 6, f"probe output too short to pick a stop string from: {text!r}"
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]

    out = tmp_path_factory.mktemp(f"oracle-{engine.arch}") / "run"
    sink = start_sink(engine.address, out)
    try:
        wait_for(lambda: manifest(out), 60, "the sink to subscribe")
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
        expected = sum(len(r.fed) for r in reqs)
        for layer in CAPTURE_LAYERS:
            wait_rows(out, layer, expected)
    finally:
        assert stop(sink) == 0, (out.parent / "run.log").read_text()[-3000:]
    return OracleRun(reqs=reqs, run=ActivationRun(out), model_path=engine.model_path)


def test_special_cases_were_exercised(oracle_run):
    by_kind = {r.kind: r for r in oracle_run.reqs}
    assert len(by_kind["max_tokens_1"].output) == 1
    ss = by_kind["stop_string"]
    assert ss.finish_reason == "stop" and len(ss.output) < 16, ss
    eo = by_kind["empty_output"]
    assert eo.finish_reason == "stop" and len(eo.output) == 1, eo
    assert sum(len(r.prompt) > MAX_BATCHED_TOKENS for r in oracle_run.reqs) >= 4


def test_every_position_stored_exactly_once(oracle_run):
    run = oracle_run.run
    total = 0
    for layer in CAPTURE_LAYERS:
        for r in oracle_run.reqs:
            positions, acts = run.request_rows(r.rid, layer)
            n = len(r.fed)
            dup = [p for p, c in Counter(positions.tolist()).items() if c > 1]
            assert not dup, f"request {r.rid} layer {layer}: duplicated positions {dup[:10]}"
            # A stop string is detected after the engine may have computed a step or two
            # more; those rows are real and contiguous, never missing in the middle.
            k = len(positions)
            assert positions.tolist() == list(range(k)), f"request {r.rid}: gaps in positions"
            if r.kind == "stop_string":
                assert k >= n
            else:
                assert k == n, f"request {r.rid} ({r.kind}): {k} rows, expected {n}"
            assert acts.shape == (k, run.hidden_size)
            total += k
    assert sum(run.manifest["rows"].values()) == total, "rows stored for unknown requests"


def test_activations_match_hf_transformers(oracle_run):
    run = oracle_run.run
    worst = {layer: 0.0 for layer in CAPTURE_LAYERS}
    for r in oracle_run.reqs:
        table = (
            run.dataset(CAPTURE_LAYERS[0])
            .to_table(
                columns=["position", "token_id"],
                filter=pc.field("request_id") == r.rid,
            )
            .sort_by("position")
        )
        captured_ids = table.column("token_id").to_pylist()
        n = len(r.fed)
        assert captured_ids[:n] == r.fed, f"request {r.rid}: token ids differ from prompt+output"
        ref = hf_post_block(oracle_run.model_path, captured_ids, CAPTURE_LAYERS)
        for layer in CAPTURE_LAYERS:
            got = run.request(r.rid, layer)
            worst[layer] = max(worst[layer], max_rel_error(got, ref[layer]))
    print(f"max relative error per layer: {worst}")
    for layer, err in worst.items():
        assert err <= 1e-3, f"layer {layer}: max relative error {err:.2e} > 1e-3"


def test_batches_mixed_prefill_chunks_and_decode(oracle_run):
    """The oracle is only meaningful if the scheduler really split and mixed batches."""
    table = oracle_run.run.dataset(CAPTURE_LAYERS[0]).to_table(
        columns=["request_id", "position", "step"]
    )
    prompt_len = {r.rid: len(r.prompt) for r in oracle_run.reqs}
    rows = zip(
        *(table.column(c).to_pylist() for c in ("request_id", "position", "step")), strict=True
    )
    prefill_steps: dict[str, set[int]] = {}
    step_kinds: dict[int, set[str]] = {}
    for rid, pos, step in rows:
        kind = "prefill" if pos < prompt_len[rid] else "decode"
        step_kinds.setdefault(step, set()).add(kind)
        if kind == "prefill":
            prefill_steps.setdefault(rid, set()).add(step)
    assert any(len(s) > 1 for s in prefill_steps.values()), "no prompt was split across steps"
    assert any(k == {"prefill", "decode"} for k in step_kinds.values()), "no mixed step"
    assert pc.max(table.column("step")).as_py() > 10


def test_late_subscriber_receives_later_steps(engine, tmp_path):
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
    assert run.manifest["rows"][f"{CAPTURE_LAYERS[0]}/post_block"] == expected


def test_dead_subscribers_do_not_stall_generation(engine, tmp_path):
    """kill -9 of a sink, and of a subscriber that never grants credit, mid-run."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    keep, doomed = tmp_path / "keep", tmp_path / "doomed"
    sink = start_sink(engine.address, keep)
    victim = start_sink(engine.address, doomed)
    stuck = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "stuck_subscriber.py"), engine.address],
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
        positions, _ = run.request_rows(o.request_id, CAPTURE_LAYERS[0])
        assert positions.tolist() == list(range(len(o.prompt_token_ids) + 63))
