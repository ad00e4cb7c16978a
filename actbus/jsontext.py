"""JSON text from a peer, parsed within bounds: its size is checked before any parsing,
its nesting while it is parsed, and every failure is a ``ConfigError`` naming the field.

Over HTTP a request's actbus entry is JSON text (``vllm_xargs={"actbus": "<json>"}``)
and the steering endpoints' bodies are JSON; both are parsed in the API server's
process, whose event loop every other request waits on, so the work one text costs is
bounded before it starts. Python's own parser raises ``RecursionError`` on deep
nesting (an HTTP 500 if let through); it is refused here as too deep, and so is any
value nested deeper than ``MAX_DEPTH``, which no actbus field needs.
"""

from __future__ import annotations

import json
from typing import Any

from actbus.errors import ConfigError

MAX_TEXT_BYTES = 4 << 20
"""A request's actbus entry: 64 steering entries with inline vectors of a wide model fit;
larger vectors are registered by name once (``PUT /v1/actbus/vectors/NAME``)."""
MAX_DEPTH = 32
"""Nesting of lists and maps: actbus's deepest field (a tag value) allows 16."""


def parse_json_text(
    text: str | bytes, where: str, max_bytes: int = MAX_TEXT_BYTES, hint: str = ""
) -> Any:
    """``text`` parsed, or a ConfigError naming ``where``: too long (checked first),
    not JSON (``hint`` says how to send it), or nested deeper than ``MAX_DEPTH``."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ConfigError(
            f"{where}: {size} bytes of JSON, more than the {max_bytes} allowed; register "
            "large vectors by name (PUT /v1/actbus/vectors/NAME) and steer with the name"
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno}){hint}") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not valid JSON (not UTF-8)") from None
    if _too_deep(value, MAX_DEPTH):
        raise ConfigError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    return value


def _too_deep(value: Any, limit: int) -> bool:
    """Whether lists and maps nest deeper than ``limit`` (a walk without recursion,
    over containers only)."""
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v
        inner = [x for x in items if isinstance(x, (list, dict))]
        if inner:
            if depth >= limit:
                return True
            stack.extend((x, depth + 1) for x in inner)
    return False
