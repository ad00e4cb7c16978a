"""Shared fixtures: tiny models, one real vLLM engine per architecture, sink processes.

Engine start costs about a minute on CPU, so each architecture's engine is
session-scoped and shared; pytest finishes every test of one before starting
the next, so two engines never hold memory at once.
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

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2")
CAPTURE_LAYERS = [1, 3]  # 3 is the last layer of the tiny models: pre-final-norm case
MAX_BATCHED_TOKENS = 64  # small, so longer prompts are split by chunked prefill


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
    llm = LLM(
        str(tiny_models[arch]),
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=16,
        enable_prefix_caching=False,
        seed=0,
        additional_config={
            "actbus": {
                "publish": address,
                "layers": CAPTURE_LAYERS,
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
