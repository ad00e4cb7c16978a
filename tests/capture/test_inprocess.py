"""An engine core in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as RL
frameworks run vLLM): each request's end reaches subscribers when ``generate``
returns, not at the next call (``actbus.engine.frontend._wrap_inproc_get_output``);
and the stream's END when the engine shuts down, not when the process exits
(``actbus.engine.closing``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from vllm import SamplingParams

from actbus.bus import Event, Subscriber, Subscription
from tests.support.engine import start_in_process, stop_llm
from tests.support.recorder import RowRecorder

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_the_last_requests_end_when_generate_returns(tiny_models, engine_pool, tmp_path):
    engine_pool.close()  # at most one engine's memory at a time
    address = f"ipc://{tmp_path}/bus.sock"
    llm = start_in_process(
        tiny_models["qwen2"],
        {"publish": address, "layers": [0, 3]},
        max_model_len=256,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=64,
    )
    col = RowRecorder(address)
    listener = Subscriber(address, Subscription(layers=(), name="waits-for-end"))
    listener.wait_welcome(30)
    stopped = False
    try:
        outs = llm.generate(
            ["hello world", "a b c d e f g"], SamplingParams(max_tokens=4, ignore_eos=True)
        )
        # No further step runs: before the fix these ends came with the next generate.
        col.wait_ended([(o.request_id, 0) for o in outs], timeout=30)
        for o in outs:
            assert col.ended[(o.request_id, 0)] == "length"
            pos, tok, _ = col.get(o.request_id, 3, "post_block")
            fed = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1]
            assert pos.tolist() == list(range(len(fed))) and tok.tolist() == fed
        # The engine shuts down, the process lives on: its subscribers hear END now
        # and its address is let go (before, both waited for the process's exit).
        stop_llm(llm)
        stopped = True
        deadline, end = time.monotonic() + 30, None
        while end is None and time.monotonic() < deadline:
            out = listener.recv(timeout=0.5)
            if isinstance(out, Event) and out.kind == "end":
                end = out
        assert end is not None, "no END within 30 s of the engine's shutdown"
        assert not Path(address.removeprefix("ipc://")).exists()
    finally:
        listener.close()
        col.close()
        if not stopped:
            stop_llm(llm)
