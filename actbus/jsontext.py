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
import re
import sys
from typing import Any

from actbus.errors import ConfigError

MAX_TEXT_BYTES = 4 << 20
"""A request's actbus entry: 64 steering entries with inline vectors of a wide model fit;
larger vectors are registered by name once (``PUT /v1/actbus/vectors/NAME``)."""
MAX_DEPTH = 32
"""Nesting of lists and maps: actbus's deepest field (a tag value) allows 16."""
MAX_ITEMS = 1 << 16
"""Items of any one list: wider than any model's hidden size (an inline vector), more
explicit positions than a request is fed in practice (modes cover the rest). Checked
before any item is looked at, so a list of millions costs its parse, not its checks."""


def parse_json_text(
    text: str | bytes, where: str, max_bytes: int = MAX_TEXT_BYTES, hint: str = ""
) -> Any:
    """``text`` parsed, or a ConfigError naming ``where``: too long (checked first),
    not JSON (``hint`` says how to send it), an integer past Python's digits limit,
    nested deeper than ``MAX_DEPTH``, or a list longer than ``MAX_ITEMS`` (named by its
    path: ``where.positions``)."""
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
    except ValueError:  # an integer of more digits than Python turns into an int
        raise ConfigError(_long_int(text, where)) from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not valid JSON (not UTF-8)") from None
    _check_shape(value, where)
    return value


def _long_int(text: str | bytes, where: str) -> str:
    """What a refused integer of thousands of digits is, and where (found by its digits,
    not by parsing again)."""
    raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    found = re.search(rf"\d{{{sys.get_int_max_str_digits() or 4300},}}", raw)
    at = f" at column {found.start() + 1}" if found else ""
    size = f"of {found.end() - found.start()} digits" if found else "too long"
    return (
        f"{where}: an integer {size}{at}, past what any actbus field takes "
        "(positions and layers fit int32, scales float32)"
    )


def _check_shape(value: Any, where: str) -> None:
    """Refuse lists and maps nested deeper than ``MAX_DEPTH`` and a list longer than
    ``MAX_ITEMS`` (its length checked before its items are), naming the path (a walk
    without recursion, over containers only)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, list):
            if len(v) > MAX_ITEMS:
                raise ConfigError(
                    f"{where}{path}: a list of {len(v)} items, more than the {MAX_ITEMS} "
                    "any actbus field takes; send fewer (a positions mode such as 'all' "
                    "or 'prompt' instead of every position)"
                )
            inner = [(x, f"{path}[{i}]") for i, x in enumerate(v) if isinstance(x, (list, dict))]
        elif isinstance(v, dict):
            inner = [(x, f"{path}.{k}") for k, x in v.items() if isinstance(x, (list, dict))]
        else:
            continue
        if inner and depth >= MAX_DEPTH:
            raise ConfigError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
        stack.extend((x, depth + 1, sub) for x, sub in inner)
