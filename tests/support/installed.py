"""The GPU checks' first step: refuse to run where vLLM cannot load actbus.

vLLM loads actbus through its ``vllm.general_plugins`` entry point, which only an
installed actbus has. From a checkout on ``PYTHONPATH`` alone the engine serves with no
capture at all, and a check then fails minutes later with a misleading error (no
publisher, no returned rows). This says so in one line, before any engine starts.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

GROUP = "vllm.general_plugins"


def require_actbus_plugin() -> None:
    """Exit with the fix if no ``actbus`` entry point is installed in ``GROUP``; else load
    actbus alone (``VLLM_PLUGINS``), unless the caller named the plugins: a peer's plugin
    installed beside it (vllm-lens) would otherwise refuse the engine or force eager."""
    if any(ep.name == "actbus" for ep in entry_points(group=GROUP)):
        os.environ.setdefault("VLLM_PLUGINS", "actbus")
        # The engine core started by fork inherits what this process built first (the
        # tiny model: torch's and the tokenizer trainer's threads); on the GPU such a
        # child hung in its first copy to the device (py-spy: VocabParallelEmbedding.
        # weight_loader's copy_), for 300 s, in MoE and Gemma 3 checks. Spawn starts clean.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        return
    raise SystemExit(
        f"actbus is not installed as a vLLM plugin (no 'actbus' entry point in {GROUP}), so "
        "vLLM would serve without it. Install it first: python -m pip install --no-deps "
        "--no-build-isolation --target /tmp/site . && export PYTHONPATH=.:/tmp/site "
        "(docs/gpu.md, 'Running from a checkout')"
    )


def gpu_memory() -> dict:
    """A check engine's GPU memory arguments. ``ACTBUS_GPU_SHARE`` (default 0.3): the
    share of the GPU it may take. ``ACTBUS_GPU_KV_GIB``, where set: a fixed KV cache,
    which skips vLLM's memory profiling; ``tests/gpu/run_all.sh`` sets both to run
    several engines on one GPU, where one engine's profile would count a neighbour's
    allocations as its own (or fail when a neighbour frees memory meanwhile)."""
    share = float(os.environ.get("ACTBUS_GPU_SHARE", "0.3"))
    if not 0.0 < share <= 1.0:
        raise SystemExit(f"ACTBUS_GPU_SHARE: {share} is not in (0, 1]")
    kv = float(os.environ.get("ACTBUS_GPU_KV_GIB", "0"))
    if kv < 0:
        raise SystemExit(f"ACTBUS_GPU_KV_GIB: {kv} is negative")
    return {"gpu_memory_utilization": share} | (
        {"kv_cache_memory_bytes": int(kv * 2**30)} if kv else {}
    )
