"""Data parallelism on CPU: two engine cores, two publishers, one fan-in subscriber.

vLLM refuses ``LLM(..., data_parallel_size=2)`` offline ("not supported for single-
process usage"), so the engine is ``AsyncLLM`` with ``data_parallel_size=2``: vLLM's
own internal load balancing over two engine cores, each with its own worker, each
binding its rank's address of one ``{dp_rank}`` template. Requests are sent to a
chosen rank (``data_parallel_rank``), so both ranks surely serve some, and the test
knows which publisher each request's rows must come from. One engine start (two
cores) for every check here.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from actbus.bus.endpoints import connect_spec
from tests.support.engine import CAPTURE_LAYERS, HOOKS, MAX_BATCHED_TOKENS
from tests.support.oracle import hf_activations, max_rel_error
from tests.support.recorder import RowRecorder

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
LENGTHS = [5, 23, 70, 130, 9, 41, 97, 160]  # several split by chunked prefill
RETURNED = {1, 6}  # these also ask for their rows back (one per rank)


@dataclass
class Req:
    rid: str
    rank: int
    prompt: list[int]
    output: list[int]
    activations: object | None

    @property
    def fed(self) -> list[int]:
        return (self.prompt + self.output)[:-1]


@dataclass
class DPRun:
    reqs: list[Req]
    col: RowRecorder
    addresses: list[str]
    model_path: Path
    ended: dict[str, bool]
    pushed: dict[int, object]
    """Per rank, the reply of its control endpoint to a push (or why none came)."""


async def _serve(
    model: Path, template: str, spec: str, control: str
) -> tuple[list[Req], RowRecorder, dict, dict]:
    import random

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model),
            dtype="float32",
            gpu_memory_utilization=0.3,
            max_model_len=256,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            max_num_seqs=8,
            data_parallel_size=2,
            seed=0,
            # Ranks and fan-in are under test, not the compiled graph (the session
            # engines capture with torch.compile on): two eager cores start far sooner.
            enforce_eager=True,
            additional_config={
                "actbus": {
                    "publish": template,
                    "layers": CAPTURE_LAYERS,
                    "hooks": HOOKS,
                    "heartbeat_s": 0.25,
                    # Each rank's own control endpoint, as its own publisher.
                    "monitor": {"monitors": {"m": {"weight": [0.0] * hidden, "layers": [0]}}},
                    "control": control,
                }
            },
        )
    )
    print(f"\n[engine dp=2] started in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    col = RowRecorder(spec)
    rng = random.Random(77)
    vocab = engine.get_tokenizer().vocab_size

    async def one(i: int, n: int) -> Req:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        extra = {"actbus": {"return": True}} if i in RETURNED else None
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, extra_args=extra)
        outs = [
            out
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=ids),
                params,
                request_id=f"r{i}",
                data_parallel_rank=i % 2,
            )
        ]
        c = outs[-1].outputs[0]
        return Req(f"r{i}", i % 2, ids, list(c.token_ids), getattr(c, "activations", None))

    try:
        reqs = await asyncio.gather(*(one(i, n) for i, n in enumerate(LENGTHS)))
        col.wait_ended([(r.rid, 0) for r in reqs])
        pushed = {r: _push(control.replace("{dp_rank}", str(r)), hidden) for r in (0, 1)}
    finally:
        engine.shutdown()  # the front end ends each rank's stream it did not end itself
    col.wait(
        lambda c: all(row["ended"] for row in c.sub.per_publisher().values()),
        60,
        "END from both publishers",
    )
    ended = {a: row["ended"] for a, row in col.sub.per_publisher().items()}
    return reqs, col, ended, pushed


def _push(address: str, hidden: int) -> object:
    """A push to one rank's control endpoint: its reply, or why there was none."""
    import numpy as np

    from actbus.bus.control import ControlClient

    try:
        with ControlClient(address, timeout_s=20) as client:
            return client.push("m", np.ones(hidden, np.float32), [0.0])
    except Exception as e:
        return repr(e)


@pytest.fixture(scope="module")
def dp_run(tiny_models, engine_pool, tmp_path_factory) -> DPRun:
    engine_pool.close()  # at most one engine's memory at a time
    sock = tmp_path_factory.mktemp("dp")
    template = f"ipc://{sock}/actbus-{{dp_rank}}.sock"
    spec = connect_spec(template, [0, 1])
    control = f"ipc://{sock}/control-{{dp_rank}}.sock"
    reqs, col, ended, pushed = asyncio.run(_serve(tiny_models["llama"], template, spec, control))
    col.close()
    addresses = [f"ipc://{sock}/actbus-{r}.sock" for r in (0, 1)]
    return DPRun(reqs, col, addresses, tiny_models["llama"], ended, pushed)


def test_each_rank_binds_its_own_control_endpoint(dp_run):
    """vLLM resets ``data_parallel_rank`` to 0 in every engine core of a dense model:
    every rank bound rank 0's control address, and a push to rank 1's got no reply."""
    for rank, reply in dp_run.pushed.items():
        assert isinstance(reply, dict) and reply.get("version") == 2, (rank, reply)


def test_each_rank_publishes_its_requests_on_its_own_address(dp_run):
    for r in dp_run.reqs:
        sources = dp_run.col.sources[(r.rid, 0)]
        assert len(sources) == 1, f"{r.rid}: rows from {len(sources)} publishers: {sources}"
        (src,) = sources
        assert (src.address, src.dp_rank) == (dp_run.addresses[r.rank], r.rank), (r.rid, src)
    runs = {s.publisher_id for ss in dp_run.col.sources.values() for s in ss}
    assert len(runs) == 2, "two engine cores, two publisher runs"
    assert dp_run.ended == dict.fromkeys(dp_run.addresses, True)


def test_every_position_once_and_as_hf_computes_it(dp_run):
    worst = 0.0
    for r in dp_run.reqs:
        ref = hf_activations(dp_run.model_path, r.fed, CAPTURE_LAYERS, HOOKS)
        for layer in CAPTURE_LAYERS:
            for hook in HOOKS:
                positions, token_ids, acts = dp_run.col.get(r.rid, layer, hook)
                where = f"request {r.rid} (rank {r.rank}) layer {layer} {hook}"
                dup = [p for p, c in Counter(positions.tolist()).items() if c > 1]
                assert not dup, f"{where}: duplicated positions {dup[:10]}"
                assert positions.tolist() == list(range(len(r.fed))), f"{where}: not 0..n-1"
                assert token_ids.tolist() == r.fed, f"{where}: token ids differ"
                worst = max(worst, max_rel_error(acts, ref[(layer, hook)]))
    print(f"max relative error over both ranks: {worst:.2e}")
    assert worst <= 1e-3


def test_the_front_end_returns_rows_from_either_rank(dp_run):
    for r in dp_run.reqs:
        acts = r.activations
        if int(r.rid[1:]) not in RETURNED:
            assert acts is None, f"{r.rid} did not ask for its rows"
            continue
        assert acts is not None and acts.complete, f"{r.rid} (rank {r.rank}): rows missing"
        assert acts.positions.tolist() == list(range(len(r.fed)))
        for key in [(layer, hook) for layer in CAPTURE_LAYERS for hook in HOOKS]:
            _, _, bus = dp_run.col.get(r.rid, *key)
            assert bool((acts.tensors[key] == bus).all()), f"{r.rid} {key}: differs from the bus"
