"""Shared fixtures: tiny models, one real vLLM engine per architecture, sink processes.

Engine start costs about a minute on CPU, so each architecture's engine is
session-scoped and shared; pytest finishes every test of one before starting
the next, so two engines never hold memory at once. The Llama engine is the
hard one: prefix caching on, a KV cache far too small for its batches (so the
scheduler preempts and recomputes), and small prefill chunks; the tests of
selections, aborts, n>1 and faults run on it.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The capture worker then checks its host-side positions against the device's.
os.environ.setdefault("ACTBUS_CHECK_POSITIONS", "1")

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
SCHED_ARCH = "llama"
# 0: the first layer gets residual=None (pre_attn is the embeddings);
# 3: the last layer of the tiny models (post_block before the final norm).
CAPTURE_LAYERS = [0, 3]
HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block"]
MAX_BATCHED_TOKENS = 64  # small, so longer prompts are split by chunked prefill
SCHED_BLOCKS = 17  # x 32 tokens: one max_model_len request (+ the null block), no more


@dataclass
class Engine:
    llm: object
    address: str
    model_path: Path
    arch: str


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from actbus.tiny_models import build_tiny_model

    return {arch: build_tiny_model(arch) for arch in ARCHS}


@pytest.fixture(scope="session", params=ARCHS)
def engine(request, tiny_models, tmp_path_factory) -> Iterator[Engine]:
    from vllm import LLM

    arch = request.param
    sock_dir = tmp_path_factory.mktemp(f"bus-{arch}")
    address = f"ipc://{sock_dir}/bus.sock"
    t0 = time.monotonic()
    sched = arch == SCHED_ARCH
    llm = LLM(
        str(tiny_models[arch]),
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=16,
        enable_prefix_caching=True,
        block_size=32 if sched else None,
        num_gpu_blocks_override=SCHED_BLOCKS if sched else 64,
        disable_log_stats=not sched,  # the Llama engine counts preemptions
        seed=0,
        additional_config={
            "actbus": {
                "publish": address,
                "layers": CAPTURE_LAYERS,
                "hooks": HOOKS,
                # Small, so a subscriber that blocks visibly holds generation back.
                "queue_mb": 1,
                "heartbeat_s": 0.25,
                # Long, so tests see death detected by the socket, not by silence.
                "subscriber_timeout_s": 30,
            }
        },
    )
    print(f"\n[engine {arch}] started in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    yield Engine(llm=llm, address=address, model_path=tiny_models[arch], arch=arch)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture
def sched_engine(engine) -> Engine:
    """The Llama engine (tiny KV cache, prefix caching): scheduling and selection tests."""
    if engine.arch != SCHED_ARCH:
        pytest.skip(f"runs on the {SCHED_ARCH} engine only")
    return engine


def preemptions(llm) -> int:
    """How many times the engine preempted a request so far (vLLM's own counter)."""
    total = 0
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            total += int(getattr(m, "value", 0))
    return total
