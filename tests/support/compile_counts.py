"""How often an engine's worker compiled or captured a CUDA graph: the figure that shows
a hot change (a vector, a pushed weight) cost no recompile and no recapture."""

from __future__ import annotations


def compile_counts(worker) -> dict[str, int]:
    """Runs in the engine's worker (``llm.collective_rpc(compile_counts)``)."""
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter as c

    return {
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        "graphs_seen": c.num_graphs_seen,
        "backend_compilations": c.num_backend_compilations,
        "cudagraphs_captured": c.num_cudagraph_captured,
    }
