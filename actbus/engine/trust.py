"""Which callers' ``extra_args["actbus"]`` is trusted: an in-process Python caller's only.

A trusted entry may name SAE checkpoints anywhere on the host (``clamp``), pass ``Hook``
objects, and gets its returned rows without the HTTP bounds. Every network route of
vLLM (the OpenAI and Anthropic routes, ``/inference/v1/generate`` under
``--enable-scale-out``, transcription, the gRPC server, the batch runner, and any a
later vLLM adds) hands the engine sampling parameters, ``extra_args`` included, that a
peer wrote, as JSON text or as a mapping. So trust is not read off the entry's form
but off the engine the request reaches: vLLM builds its engines with a usage context,
and only the offline ``LLM`` class and engines made directly in Python (``LLMEngine``,
``AsyncLLM`` with the default context) are trusted. An engine whose context is unknown,
or that this module could not mark, is not (fail closed).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

TRUSTED_CONTEXTS = frozenset({"LLM_CLASS", "ENGINE_CONTEXT"})
ATTR = "_actbus_trusted"


def trusted(input_processor: Any) -> bool:
    """Whether the engine that owns ``input_processor`` serves in-process Python only."""
    return getattr(input_processor, ATTR, False) is True


def _wrap_init(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            ctx = bound.arguments.get("usage_context")
        except TypeError:
            ctx = None
        name = str(getattr(ctx, "value", ctx))
        processor = getattr(self, "input_processor", None)
        if processor is not None:
            setattr(processor, ATTR, name in TRUSTED_CONTEXTS)

    return __init__


def patch() -> None:
    """Mark each engine's input processor as it is made."""
    for module, name in (
        ("vllm.v1.engine.llm_engine", "LLMEngine"),
        ("vllm.v1.engine.async_llm", "AsyncLLM"),
    ):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if not getattr(cls, "_actbus_trust_patched", False):
            cls.__init__ = _wrap_init(cls.__init__)
            cls._actbus_trust_patched = True
