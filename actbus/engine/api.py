"""Steering a running engine from Python: named vectors and global steering.

Both live in the front end (``SteerFrontend``), so a change costs the engine nothing:
no message to the workers, no recompilation, no CUDA graph recapture. Requests
admitted after the change use it; requests already running keep what they started
with.

    from actbus.engine.api import set_global, vectors
    from actbus.steer.config import VectorSource

    vectors(llm).register("joy", VectorSource("sae", "runs/sae-l3", feature=12))
    vectors(llm).register("calm", torch.randn(4096))
    set_global(llm, [{"vector": "calm", "layers": [3], "scale": 2.0}])
"""

from __future__ import annotations

from typing import Any

from actbus.engine.frontend import frontend_for
from actbus.errors import ConfigError
from actbus.steer.frontend import SteerFrontend
from actbus.steer.vectors import VectorRegistry


def steering(llm: Any) -> SteerFrontend:
    """The steering front end of an offline ``LLM``, an ``LLMEngine`` or an ``AsyncLLM``."""
    engine = getattr(llm, "llm_engine", llm)
    processor = getattr(engine, "input_processor", None)
    if processor is None:
        raise ConfigError(f"actbus: {type(llm).__name__} has no input processor to steer with")
    fe = frontend_for(processor)
    steer = getattr(fe, "steer", None) if fe.active else None
    if steer is None:
        raise ConfigError(
            "actbus.steer: this engine does not steer; add a 'steer' entry to its actbus config"
        )
    return steer


def vectors(llm: Any) -> VectorRegistry:
    """The engine's named vectors: ``register(name, values_or_source)``, ``remove``,
    ``names``."""
    return steering(llm).registry


def set_global(llm: Any, entries: list[dict[str, Any]]) -> None:
    """Replace the global steering (entries as in a request's ``steer`` list); ``[]``
    turns it off."""
    steering(llm).set_global(entries)
