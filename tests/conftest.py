"""Session-wide fixtures: tiny models and the shared vLLM engines.

Each folder (bus, capture, fs, trainers, dashboard) has its own conftest for what only
its tests use; shared helpers live in ``tests/support``. Engine tests are ordered so
that each architecture's engine starts once (``tests/support/engine.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine import ARCHS, SCHED_ARCH, Engine, EnginePool

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The capture worker then checks its host-side positions against the device's.
os.environ.setdefault("ACTBUS_CHECK_POSITIONS", "1")
# Tests read counters in the engine's worker with ``llm.collective_rpc(function)``,
# which vLLM sends pickled only when this is set (tests/steer: no recompilation).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# Every engine the suite starts (servers, examples and README blocks in their own
# processes included) gets 1 GiB of KV cache, unless it sets its blocks: unset,
# ``gpu_memory_utilization=0.3`` gives each about 7 GiB of this machine's RAM, and two
# or three at once (a data-parallel pair, a server beside an example's) ran the
# 24 GiB machine out of memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from actbus.tiny_models import build_tiny_model

    return {arch: build_tiny_model(arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def engine_pool(tiny_models, tmp_path_factory) -> Iterator[EnginePool]:
    pool = EnginePool(tiny_models, tmp_path_factory.mktemp("engines"))
    yield pool
    pool.close()


@pytest.fixture(scope="session", params=ARCHS)
def engine(request, engine_pool) -> Engine:
    """Each architecture's engine in turn: the capture oracle runs on all six."""
    return engine_pool.get(request.param)


@pytest.fixture
def sched_engine(engine_pool) -> Engine:
    """The Llama engine (tiny KV cache, prefix caching): scheduling and selection tests."""
    return engine_pool.get(SCHED_ARCH)


ENGINE_FIXTURES = {"engine", "sched_engine", "tiny_models"}


def _engine_arch(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    if "engine" in names:
        return item.callspec.params["engine"]
    if "sched_engine" in names:
        return SCHED_ARCH
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Whatever starts an engine is slow: marked ``engine``, so ``-m "not engine"`` skips it."""
    if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.engine)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests without a shared engine first, then each architecture's block in turn.

    A stable sort: within a block pytest's own order stays, so session fixtures built
    on ``engine`` (the oracle run) are still made once per architecture.
    """
    order = {arch: i for i, arch in enumerate(ARCHS)}
    items.sort(key=lambda it: -1 if (a := _engine_arch(it)) is None else order[a])
