"""Which data-parallel ranks a vLLM process stands for.

Each DP rank is an engine core of its own, with its own workers, so each binds its
own publisher (``CaptureConfig.publish_address``). Two views of the rank:

- a worker's rank (``worker_rank``): vLLM keeps it in ``parallel_config.
  data_parallel_index``, because for dense models each engine core is made to look
  like DP=1 (``data_parallel_rank`` and ``data_parallel_size`` reset to 0 and 1);
  the front end's size is carried to the workers in the actbus config (``_dp_size``);
- a front end's ranks (``of_config``): the ranks whose engine cores run on this node
  (``local``: from ``data_parallel_rank``, the node's start rank, and
  ``data_parallel_size_local``) and the ranks it sends requests to (``served``: all
  of them under internal load balancing, its own under external or hybrid).
"""

from __future__ import annotations

from typing import Any

from actbus.config import DataParallel
from actbus.errors import ConfigError

__all__ = ["DataParallel", "front_size", "of_args", "of_config", "worker_rank"]

SIZE_KEY = "_dp_size"
"""Where ``session.validate`` leaves the front end's data-parallel size for the workers."""


def of_config(vllm_config: Any) -> DataParallel:
    """The front end's layout, from its (unreduced) parallel config."""
    pc = vllm_config.parallel_config
    size = int(getattr(pc, "data_parallel_size", 1) or 1)
    if size <= 1:
        return DataParallel(1, (0,), (0,))
    start = int(getattr(pc, "data_parallel_rank", 0) or 0)
    n_local = int(getattr(pc, "data_parallel_size_local", None) or size)
    local = tuple(range(start, start + n_local))
    own = getattr(pc, "data_parallel_external_lb", False) or getattr(
        pc, "data_parallel_hybrid_lb", False
    )
    return DataParallel(size, local, local if own else tuple(range(size)))


def front_size(vllm_config: Any) -> int:
    """The data-parallel size as the front end saw it (a worker's own config may say 1)."""
    pc = vllm_config.parallel_config
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("actbus") if isinstance(extra, dict) else None
    carried = raw.get(SIZE_KEY, 1) if isinstance(raw, dict) else 1
    return max(int(getattr(pc, "data_parallel_size", 1) or 1), int(carried))


def worker_rank(vllm_config: Any) -> int:
    """The data-parallel rank of the engine core this worker belongs to."""
    pc = vllm_config.parallel_config
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        if front_size(vllm_config) > 1 and int(getattr(pc, "data_parallel_size", 1) or 1) == 1:
            raise ConfigError(
                "actbus.publish: this vLLM does not say which data-parallel rank a worker "
                "serves (no parallel_config.data_parallel_index), so every rank would bind "
                "rank 0's address; run one engine per process with its own actbus.publish "
                "(external load balancing), or upgrade vLLM"
            )
        rank = getattr(pc, "data_parallel_rank", 0) or 0
    return int(rank)


def of_args(vllm_args: list[str]) -> tuple[int, list[int]]:
    """(data-parallel size, the ranks whose engines a server runs), from ``vllm serve``
    arguments (``actbus serve`` reads them before vLLM starts), read by vLLM's
    own argument parser: external load balancing (``--data-parallel-rank``) runs one
    rank, a node of a multi-node deployment (``--data-parallel-start-rank``) its
    ``--data-parallel-size-local`` ranks from there, one node all of them. vLLM is
    imported only when an argument can set data parallelism (``-dp*``,
    ``--data-parallel-*``, ``--config``)."""
    if not any(a.startswith(("-dp", "--data-parallel", "--config")) for a in vllm_args):
        return 1, [0]
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(add_help=False)
    EngineArgs.add_cli_args(p)
    try:
        a, _ = p.parse_known_args(vllm_args)
    except SystemExit:
        raise ConfigError(
            "--data-parallel-*: vLLM could not read them (see vllm serve -h)"
        ) from None
    size = max(1, int(a.data_parallel_size or 1))
    if a.data_parallel_rank is not None:
        return size, [int(a.data_parallel_rank)]
    start = int(a.data_parallel_start_rank or 0)
    return size, list(range(start, start + int(a.data_parallel_size_local or size - start)))
