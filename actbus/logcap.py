"""Capped text of values a peer sent, for log lines and error messages.

A peer can put megabytes into one field, and a log line that quotes the field
whole grows the log by as much (a 10 MB field once became a 52 MB log). Every log
line and error message that quotes a peer's value goes through ``capped``: its
``repr`` (so a newline in it cannot forge a log line), cut to a bounded length,
at a cost bounded by that length whatever the value's size. ``capped_text`` does
the same for a message that may hold such a value (an exception's text), unquoted.

Peers can also make many lines: thousands of subscribers joining once wrote one
line each. Lines that peers cause go through a ``LogRate``, which lets a burst
through and then a few a second, and counts what it held back.
"""

from __future__ import annotations

import logging
import reprlib
import time
from collections.abc import Callable

OWN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

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


class LogRate:
    """Log lines that peers cause: at most ``burst`` at once, then ``per_s`` a second.

    Lines held back are counted (``held``), and the next line let through says how
    many there were. Not thread-safe: one instance per thread that logs through it.
    """

    def __init__(
        self, per_s: float = 1.0, burst: int = 10, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_s = per_s
        self.burst = burst
        self.held = 0  # held back since the last line let through
        self.held_total = 0
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def log(self, logger: logging.Logger, level: int, msg: str, *args: object) -> bool:
        """``logger.log(level, msg, *args)`` if the rate allows; True if it was logged.
        A level the logger does not emit costs nothing and spends no allowance."""
        if not logger.isEnabledFor(level):
            return False
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.per_s)
        self._last = now
        if self._tokens < 1:
            self.held += 1
            self.held_total += 1
            return False
        self._tokens -= 1
        if self.held:
            msg = f"{msg} ({self.held} earlier lines held back: too many, too fast)"
            self.held = 0
        logger.log(level, msg, *args)
        return True


def show_own_logs(fmt: str = OWN_FORMAT) -> None:
    """actbus's own INFO lines on stderr, and only actbus's (a command whose other
    libraries keep their own handlers, or none); nothing if logging is set up already."""
    ours = logging.getLogger("actbus")
    if ours.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(fmt))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
