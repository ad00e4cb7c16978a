"""Engine-core side of steering's prefix-cache salt: blocks holding steered KV hash apart.

vLLM hashes each full block of a request's tokens, chained from the first block, and a
later request reuses a block whose hash it shares. A request's ``cache_salt`` enters
only the first block's hash, so it separates every block, the unsteered prompt ones
too. Steering changes the KV of its steered positions and of every position after
them, and of none before. So the front end gives a steered request
``extra_args["actbus"]["kv_salt"] = [first, salt]`` (``RequestSteer.kv_salt``): the
first position whose stream the steering may change, and a digest of that steering.
Wrapped here, ``generate_block_hash_extra_keys`` adds the salt to the block holding
``first``; the chain carries it to every block after, while the blocks before keep
their plain hashes. A request steered only on its generated tokens still reads (and
shares) its prompt's cached blocks; no other request reads the blocks its steered
tokens are in, unless it asks for the same steering at the same positions.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

KEY = "kv_salt"
MODULES = (
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.block_pool",  # the KV events' hashes: the same extra keys
    "vllm.v1.simple_kv_offload.manager",
)
FUNCTION = "generate_block_hash_extra_keys"
PARAMS = ("request", "start_token_idx", "end_token_idx")
"""The leading parameters the wrapper reads (``actbus.engine.internals``)."""


def salt_of(request: Any) -> list | None:
    """``[first, salt]`` of a request the front end salted, else None."""
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None) if sp is not None else None
    wire = extra.get("actbus") if isinstance(extra, dict) else None
    return wire.get(KEY) if isinstance(wire, dict) else None


def _wrap(orig):
    @functools.wraps(orig)
    def generate_block_hash_extra_keys(
        request: Any, start_token_idx: int, end_token_idx: int, *args: Any, **kwargs: Any
    ):
        keys, nxt = orig(request, start_token_idx, end_token_idx, *args, **kwargs)
        salt = salt_of(request)
        if salt is not None and start_token_idx <= salt[0] < end_token_idx:
            keys = (*(keys or ()), ("actbus_steer", salt[1]))
        return keys, nxt

    generate_block_hash_extra_keys._actbus_wrapper = True
    return generate_block_hash_extra_keys


def patch() -> bool:
    """Wrap the function where vLLM's modules call it (each imported it by name)."""
    try:
        base = importlib.import_module(MODULES[0])
    except ImportError:
        return False
    orig = getattr(base, FUNCTION, None)
    if orig is None:
        return False
    if getattr(orig, "_actbus_wrapper", False):
        return True
    wrapped = _wrap(orig)
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, FUNCTION, None) is orig:
            setattr(mod, FUNCTION, wrapped)
    return True
