"""What an engine closes when it shuts down: its publisher and its push endpoint.

An engine core or worker in a process of its own closes them when that process exits
(``atexit``). One in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
notebooks and RL frameworks run vLLM) outlives its engine: without this, its publisher
would never send END, so trainers and ``--exit-on-end`` consumers would wait on, and it
would hold its address, shared memory and thread until the process exits. Whatever
opens such a thing registers its ``close`` here under the engine's config; the engine
core's ``shutdown`` closes them (``actbus.engine.frontend``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("actbus")
_OPEN: dict[str, list[Callable[[], None]]] = {}
_LOCK = threading.Lock()


def key(vllm_config: Any) -> str:
    """One engine's key: vLLM's instance id of its config (the same in every copy)."""
    return str(getattr(vllm_config, "instance_id", "") or id(vllm_config))


def on_shutdown(vllm_config: Any, close: Callable[[], None]) -> None:
    """Call ``close`` (idempotent: exit may call it again) when this engine shuts down."""
    with _LOCK:
        _OPEN.setdefault(key(vllm_config), []).append(close)


def shut_down(vllm_config: Any) -> int:
    """Close what this engine opened in this process, last opened first; how many."""
    with _LOCK:
        closers = _OPEN.pop(key(vllm_config), [])
    for close in reversed(closers):
        try:
            close()
        except Exception:  # one failing close must not keep the others open
            log.exception("actbus: closing %r at engine shutdown failed", close)
    return len(closers)
