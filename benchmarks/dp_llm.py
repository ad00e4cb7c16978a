"""Data parallelism for the engine benchmarks: an ``AsyncLLM`` behind the offline
``LLM``'s ``generate``.

vLLM refuses ``LLM(data_parallel_size=N)`` ("not supported for single-process
usage"), so an arm at ``--dp N`` runs ``AsyncLLM`` with ``data_parallel_size=N``, as
``tests/capture/test_dp.py`` does: each request is sent to a chosen rank
(``data_parallel_rank``, round-robin over the prompts), all at once, and each rank's
engine core publishes on its own address of actbus's ``{dp_rank}`` template. The
event loop runs in a thread of its own, so a benchmark calls ``generate`` as it calls
the offline ``LLM``'s, and steering's ``vectors(llm)`` finds the ``AsyncLLM`` as
``llm.llm_engine``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class DataParallelLLM:
    """``generate(prompts, params)`` over ``data_parallel_size`` engine cores: each
    prompt on rank ``index % N``, every request at once; outputs in prompt order, and
    the rank that served each in ``ranks`` (by request id)."""

    def __init__(self, model: str, *, data_parallel_size: int, **settings: Any) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.dp = data_parallel_size
        self.ranks: dict[str, int] = {}
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dp-llm", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(model=model, data_parallel_size=data_parallel_size, **settings)
        self.llm_engine = self._run(self._start(args))

    @staticmethod
    async def _start(args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args)  # in the loop that will serve it

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool = False) -> list[Any]:
        """Every prompt's final ``RequestOutput``, in prompt order (``params``: one
        ``SamplingParams`` for all, or one per prompt; ``use_tqdm`` is ignored)."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} sampling params for {len(prompts)} prompts")

        async def one(i: int, prompt: Any, sp: Any) -> Any:
            rid, rank = f"dp{next(self._ids)}", i % self.dp
            self.ranks[rid] = rank
            last = None
            async for out in self.llm_engine.generate(
                prompt, sp, request_id=rid, data_parallel_rank=rank
            ):
                last = out
            if last is None or not last.finished:
                raise RuntimeError(f"request {rid} (rank {rank}) ended without a final output")
            return last

        async def every() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(one(i, *x) for i, x in enumerate(zip(prompts, per, strict=True)))
                )
            )

        return self._run(every())

    def shutdown(self) -> None:
        """Stop the engine cores (the front end ends each rank's stream), then the loop."""
        engine, self.llm_engine = self.llm_engine, None  # not again at exit (__del__)
        try:
            engine.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
