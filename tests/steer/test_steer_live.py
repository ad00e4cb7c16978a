"""Live steering vectors on the Llama engine, pushed over its CURVE control endpoint.

A request admitted after a push steers with the pushed values (against HF transformers
with the same vector hooked in) and its captured rows carry the push's version; a
request admitted before keeps its version to its end; bad pushes are refused, naming
the field, and the version in use stays; prompt steering with a live vector never
reads another version's prompt KV; nothing is recompiled. Each test puts the vector
back to zeros.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict

import numpy as np
import pytest

from actbus.bus import Batch, Subscriber, Subscription
from actbus.bus.control import PushRefused
from tests.monitor.test_monitor_push import _client
from tests.steer.test_steer_engine import _check, _params, _prompts, _stream_norm, _vectors
from tests.steer.test_steer_requests import _generate
from tests.support.compile_counts import compile_counts
from tests.support.steer_oracle import HFSteer

pytestmark = pytest.mark.engine


class RowVersions:
    """Per request (caller id): the live vector versions its captured rows carry."""

    def __init__(self, address: str) -> None:
        self.sub = Subscriber(
            address, Subscription(layers=(3,), hooks=("post_block",), name="live-rows")
        )
        self.sub.wait_welcome(30)
        self.seen: dict[str, list[dict]] = defaultdict(list)
        self.ended: set[str] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            out = self.sub.recv(timeout=0.2)
            if not isinstance(out, Batch):
                continue
            rows = out.header.rows
            for i, rid in enumerate(rows.request_ids):
                self.seen[rid].append(rows.request_steer_versions(i))
            self.ended |= {e.request_id for e in out.header.ended}

    def has(self, rid: str) -> bool:
        """Some of ``rid``'s rows have arrived (so a worker admitted it)."""
        return bool(self.seen.get(rid))

    def versions(self, rid: str, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while rid not in self.ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rid in self.ended, f"{rid}: its end never arrived"
        return self.seen[rid]

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=10)
        self.sub.close()


def test_a_push_steers_requests_admitted_after_it_and_rows_carry_its_version(sched_engine):
    from vllm.inputs import TokensPrompt

    llm, eng = sched_engine.llm, sched_engine.llm.llm_engine
    vocab = llm.get_tokenizer().vocab_size
    hidden = eng.vllm_config.model_config.get_hidden_size()
    prompts = _prompts(vocab, 3, seed=71)
    v1, v2 = _vectors(hidden, 2, 2.0 * _stream_norm(sched_engine.model_path, prompts[0]), seed=12)
    plain = [{"vector": "live_dir", "layers": 2}]
    matched = [
        {"vector": "live_dir", "layers": 1, "hooks": "post_attn", "norm_match": True, "scale": 0.8}
    ]
    rows = RowVersions(sched_engine.address)
    before = llm.collective_rpc(compile_counts)
    assert before[0]["dynamo_graphs"] > 0, before
    with _client(sched_engine) as c:
        start = c.status()["vectors"]["live_dir"]["version"]
        try:
            assert c.push_vector("live_dir", v1.numpy())["version"] == start + 1
            first = _generate(llm, [prompts[0]], [_params(plain)])[0]
            eng.add_request("live-old", TokensPrompt(prompt_token_ids=prompts[1]), _params(matched))
            done = {}
            deadline = time.monotonic() + 120
            # The next push must land after live-old was admitted: its first rows show it
            # (one step() can return before the engine core scheduled it).
            while not rows.has("live-old") and time.monotonic() < deadline:
                done |= {o.request_id: o for o in eng.step() if o.finished}
                time.sleep(0 if eng.has_unfinished_requests() else 0.01)
            assert rows.has("live-old"), "live-old's rows never came"
            assert c.push_vector("live_dir", v2.numpy())["version"] == start + 2
            eng.add_request("live-new", TokensPrompt(prompt_token_ids=prompts[2]), _params(matched))
            while eng.has_unfinished_requests() and time.monotonic() < deadline:
                done |= {o.request_id: o for o in eng.step() if o.finished}
            st = c.status()
        finally:
            c.push_vector("live_dir", np.zeros(hidden, dtype=np.float32))
            rows.close()
    after = llm.collective_rpc(compile_counts)
    assert before == after, (before, after)
    _check(first, sched_engine.model_path, [HFSteer(2, "post_block", v1)])
    _check(done["live-old"], sched_engine.model_path, [HFSteer(1, "post_attn", v1, 0.8, True)])
    _check(done["live-new"], sched_engine.model_path, [HFSteer(1, "post_attn", v2, 0.8, True)])
    for rid, version in ((first.request_id, start + 1), ("live-old", start + 1)):
        seen = rows.versions(rid)
        assert seen and all(s == {"live_dir": version} for s in seen), (rid, seen)
    seen = rows.versions("live-new")
    assert seen and all(s == {"live_dir": start + 2} for s in seen), seen
    assert st["vectors"]["live_dir"] == {"version": start + 2, "in_use": start + 2}
    swaps = [s for s in st["swaps"] if s.get("vector") == "live_dir"][-2:]
    assert [s["version"] for s in swaps] == [start + 1, start + 2]
    assert all(0 <= s["swap_ms"] < 30_000 for s in swaps)


def test_bad_vector_pushes_are_refused_and_the_version_in_use_stays(sched_engine):
    llm = sched_engine.llm
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompt = _prompts(llm.get_tokenizer().vocab_size, 1, seed=73)[0]
    (v,) = _vectors(hidden, 1, 2.0 * _stream_norm(sched_engine.model_path, prompt), seed=13)
    with _client(sched_engine) as c:
        try:
            version = c.push_vector("live_dir", v.numpy())["version"]
            w = v.numpy()
            bad = [
                (("live_dir", w[:-1]), "values", f"shape [{hidden - 1}] does not fit live vector"),
                (("live_dir", np.where(np.arange(hidden) == 5, np.nan, w)), "values", "NaN or Inf"),
                (
                    ("live_dri", w),
                    "vector",
                    "no live steering vector named 'live_dri' on this engine (known: live_dir, "
                    "live_sae)",
                ),
                (("live_dir", w, version), "version", f"{version} is not above"),
            ]
            for args, field, msg in bad:
                with pytest.raises(PushRefused, match=re.escape(msg)) as e:
                    c.push_vector(*args)
                assert e.value.field == field
            assert c.status()["vectors"]["live_dir"]["version"] == version
            out = _generate(llm, [prompt], [_params([{"vector": "live_dir", "layers": 3}])])[0]
            _check(out, sched_engine.model_path, [HFSteer(3, "post_block", v)])
        finally:
            c.push_vector("live_dir", np.zeros(hidden, dtype=np.float32))


def test_prompt_steering_with_a_live_vector_never_reads_another_versions_cache(sched_engine):
    llm = sched_engine.llm
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    prompt = _prompts(llm.get_tokenizer().vocab_size, 1, seed=75, length=80)[0]  # 2+ blocks
    v1, v2 = _vectors(hidden, 2, 2.0 * _stream_norm(sched_engine.model_path, prompt), seed=14)
    prefill = [{"vector": "live_dir", "layers": 1, "tier": "prefill"}]
    decode = [{"vector": "live_dir", "layers": 1, "tier": "decode"}]

    def run(steer):
        return _generate(llm, [prompt], [_params(steer, ret="generated")])[0]

    with _client(sched_engine) as c:
        try:
            c.push_vector("live_dir", v1.numpy())
            outs = [run(prefill), run(prefill)]
            c.push_vector("live_dir", v2.numpy())
            outs += [run(prefill), run(None), run(decode)]
        finally:
            c.push_vector("live_dir", np.zeros(hidden, dtype=np.float32))
    cached = [o.num_cached_tokens for o in outs]
    assert cached[:3] == [0, 0, 0], f"live prefill steering read a cached prompt: {cached}"
    assert cached[4] >= 64, f"decode-only live steering lost the prompt's cache hits: {cached}"
    for o, v in ((outs[0], v1), (outs[2], v2)):
        _check(
            o, sched_engine.model_path, [HFSteer(1, "post_block", v, tier="prefill")], "generated"
        )
    _check(
        outs[4], sched_engine.model_path, [HFSteer(1, "post_block", v2, tier="decode")], "generated"
    )
