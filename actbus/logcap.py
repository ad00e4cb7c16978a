"""Capped text of values a peer sent, for log lines and error messages.

A peer can put megabytes into one field, and a log line that quotes the field
whole grows the log by as much (a 10 MB field once became a 52 MB log). Every log
line and error message that quotes a peer's value goes through ``capped``: its
``repr`` (so a newline in it cannot forge a log line), cut to a bounded length,
at a cost bounded by that length whatever the value's size. ``capped_text`` does
the same for a message that may hold such a value (an exception's text), unquoted.
"""

from __future__ import annotations

import reprlib

MAX_CHARS = 120
"""Characters of one quoted value, at most (plus a short note of what was cut)."""

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = MAX_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8
_repr.maxlevel = 3


def capped(value: object, limit: int = MAX_CHARS) -> str:
    """``repr(value)``, at most ``limit`` characters plus a note of the full size."""
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        n = len(value)
        if n <= limit:
            return repr(value if not isinstance(value, memoryview) else bytes(value))
        unit = "characters" if isinstance(value, str) else "bytes"
        head = value[:limit]
        return f"{bytes(head) if isinstance(head, memoryview) else head!r}... ({n} {unit})"
    text = _repr.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... (cut)"


def capped_text(text: str, limit: int = 4 * MAX_CHARS) -> str:
    """``text`` on one line (newlines escaped), cut to ``limit`` characters."""
    n = len(text)
    cut = text[:limit].replace("\r", "\\r").replace("\n", "\\n")
    return cut if n <= limit else f"{cut}... ({n} characters)"
