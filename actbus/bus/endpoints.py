"""What ``--connect`` names: one publisher, or several (fan-in).

Three spellings, combinable where it makes sense:

- ``ADDR``: one publisher (``ipc:///tmp/actbus.sock``, ``tcp://HOST:5555``);
- ``A,B,C``: a list of addresses;
- a rank range in braces, ``ipc:///tmp/actbus-{0..3}.sock`` or
  ``tcp://HOST:{5555..5558}``: one address per integer, both ends included (one
  range per address; it may appear in a list item);
- ``@FILE``: a file listing endpoints, one per line (``#`` starts a comment, blank
  lines are skipped, lines may use ranges). The file is read again whenever it
  changes, so a fleet that scales up or down needs no restart of its subscribers; a
  new list is taken once it has stayed the same for ``FILE_SETTLE_S`` (a file that
  keeps flipping cannot make its subscribers re-subscribe over and over).

At most ``MAX_ENDPOINTS`` publishers, counted as a spec or a file is read (a range is
counted before it is expanded), and a file of at most ``MAX_FILE_BYTES``: a listing of
thousands of ranges is refused at once, not parsed for seconds.

Every address is checked as ``check_address`` checks it (errors name ``--connect``).

A publisher's side of the same grammar is its data-parallel template
(``actbus.publish``): ``{dp_rank}`` or ``{BASE+dp_rank}`` in place of the range, filled
with the rank of the engine that binds it (``for_rank``). So ``ipc:///tmp/actbus-{dp_rank}.sock``
on four ranks is read with ``ipc:///tmp/actbus-{0..3}.sock``, and
``tcp://0.0.0.0:{5555+dp_rank}`` with ``tcp://HOST:{5555..5558}`` (``connect_spec``
writes that spelling). Both sides find their one ``{...}`` with ``_braces``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actbus.bus.addresses import check_address
from actbus.errors import ConfigError
from actbus.logcap import LogRate

log = logging.getLogger("actbus.endpoints")
MAX_ENDPOINTS = 1024
"""More publishers than this in one spec is a typo (a range of ports, say)."""
MAX_FILE_BYTES = 1 << 20
"""An endpoints file larger than this is refused (1,024 addresses take ~100 KB)."""
FILE_SETTLE_S = 3.0
"""A changed endpoints file is applied once its new list has stayed this long."""
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")
_RANK = re.compile(r"(?:(\d+)\+)?dp_rank")
RANGE_EXAMPLE = "ipc:///tmp/actbus-{0..3}.sock"
RANK_EXAMPLE = "ipc:///tmp/actbus-{dp_rank}.sock or tcp://127.0.0.1:{5555+dp_rank}"


def _braces(item: str, field_name: str, example: str) -> tuple[str, str, str] | None:
    """``item`` split around its one ``{...}`` as (before, inside, after); None: none."""
    found = list(_BRACES.finditer(item))
    if len(found) > 1:
        raise ConfigError(
            f"{field_name}={item!r}: one {{A..B}} range or {{dp_rank}} per address, not several"
        )
    rest = item if not found else item[: found[0].start()] + item[found[0].end() :]
    if "{" in rest or "}" in rest:
        raise ConfigError(f"{field_name}={item!r}: an unmatched brace; write e.g. {example}")
    if not found:
        return None
    m = found[0]
    return item[: m.start()], m.group(1), item[m.end() :]


def expand(item: str, *, field_name: str = "--connect", room: int = MAX_ENDPOINTS) -> list[str]:
    """One address, or the addresses of its rank range, each checked; more than
    ``room`` of them is refused before any is built."""
    parts = _braces(item, field_name, RANGE_EXAMPLE)
    if parts is None:
        return [check_address(item, field_name=field_name, allow_remote=True)]
    before, inside, after = parts
    m = _RANGE.fullmatch(inside)
    if m is None:
        hint = (
            " ({dp_rank} is the publisher's template; a subscriber names the ranks it reads)"
            if _RANK.fullmatch(inside)
            else ""
        )
        raise ConfigError(
            f"{field_name}={item!r}: a rank range is written {{FIRST..LAST}}, "
            f"e.g. {RANGE_EXAMPLE}{hint}"
        )
    lo, hi = (int(x) for x in m.groups())
    if hi < lo:
        raise ConfigError(f"{field_name}={item!r}: the range {{{lo}..{hi}}} runs backwards")
    if hi - lo + 1 > room:
        raise ConfigError(f"{field_name}={item!r}: at most {MAX_ENDPOINTS} publishers in all")
    return [
        check_address(f"{before}{i}{after}", field_name=field_name, allow_remote=True)
        for i in range(lo, hi + 1)
    ]


def _rank_part(template: str, field_name: str) -> tuple[str, int, str] | None:
    """(before, base, after) of a template's ``{BASE+dp_rank}``; None: no rank in it."""
    parts = _braces(template, field_name, RANK_EXAMPLE)
    if parts is None:
        return None
    before, inside, after = parts
    m = _RANK.fullmatch(inside)
    if m is None:
        hint = " (a range is for subscribers' --connect)" if _RANGE.fullmatch(inside) else ""
        raise ConfigError(
            f"{field_name}={template!r}: a data-parallel template is written {{dp_rank}} or "
            f"{{BASE+dp_rank}}, e.g. {RANK_EXAMPLE}{hint}"
        )
    return before, int(m.group(1) or 0), after


def has_rank(template: str, field_name: str = "actbus.publish") -> bool:
    """Whether a publisher's address template differs by data-parallel rank."""
    return _rank_part(template, field_name) is not None


def for_rank(template: str, dp_rank: int, field_name: str = "actbus.publish") -> str:
    """The address the publisher of data-parallel rank ``dp_rank`` binds (unchecked:
    the caller checks it as a bind address)."""
    parts = _rank_part(template, field_name)
    if parts is None:
        return template
    before, base, after = parts
    return f"{before}{base + dp_rank}{after}"


def connect_spec(template: str, ranks: list[int], field_name: str = "actbus.publish") -> str:
    """The ``--connect`` that reads the publishers of ``ranks`` (a range when they are
    consecutive): what a subscriber is told to use."""
    parts = _rank_part(template, field_name)
    if parts is None or not ranks:
        return template
    before, base, after = parts
    lo, hi = min(ranks), max(ranks)
    if lo == hi:
        return f"{before}{base + lo}{after}"
    if sorted(ranks) == list(range(lo, hi + 1)):
        return f"{before}{{{base + lo}..{base + hi}}}{after}"
    return ",".join(f"{before}{base + r}{after}" for r in sorted(ranks))


def _unique(addresses: list[str], field_name: str, where: str) -> list[str]:
    seen: set[str] = set()
    for a in addresses:
        if a in seen:
            raise ConfigError(f"{field_name}: {a} is listed twice{where}; list each publisher once")
        seen.add(a)
    if len(addresses) > MAX_ENDPOINTS:
        raise ConfigError(f"{field_name}: {len(addresses)} publishers, at most {MAX_ENDPOINTS}")
    return addresses


def read_file(path: Path, field_name: str = "--connect") -> list[str]:
    """The endpoints listed in ``path`` (errors name the file and line); the caps
    (``MAX_FILE_BYTES``, ``MAX_ENDPOINTS``) apply as it is read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            f"{field_name}=@{path}: cannot read the endpoints file: {e.strerror or e}"
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{field_name}=@{path}: the endpoints file is over {MAX_FILE_BYTES} bytes; list "
            f"at most {MAX_ENDPOINTS} publishers, one a line"
        )
    text = raw.decode(errors="replace")
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{field_name}=@{path} line {n}"
        if len(out) >= MAX_ENDPOINTS:
            raise ConfigError(f"{where}: more than {MAX_ENDPOINTS} publishers in the file")
        out += expand(line, field_name=where, room=MAX_ENDPOINTS - len(out))
    return _unique(out, field_name, f" in {path}")


@dataclass(frozen=True)
class Endpoints:
    """A parsed ``--connect``: fixed addresses, or a file to follow."""

    spec: str
    addresses: tuple[str, ...] = ()
    """The fixed addresses (empty for ``@FILE``: see ``current``)."""
    file: Path | None = None

    @classmethod
    def parse(cls, spec: str, field_name: str = "--connect") -> Endpoints:
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"{field_name}: expected an address, a list A,B or @FILE")
        spec = spec.strip()
        if spec.startswith("@"):
            path = Path(spec[1:]).expanduser()
            read_file(path, field_name)  # checked now: a bad file fails at start
            return cls(spec, (), path)
        items = [s.strip() for s in spec.split(",")]
        if not all(items):
            raise ConfigError(f"{field_name}={spec!r}: an empty item in the list")
        out: list[str] = []
        for item in items:
            if len(out) >= MAX_ENDPOINTS:
                raise ConfigError(f"{field_name}: more than {MAX_ENDPOINTS} publishers")
            out += expand(item, field_name=field_name, room=MAX_ENDPOINTS - len(out))
        return cls(spec, tuple(_unique(out, field_name, "")), None)

    @property
    def fan_in(self) -> bool:
        """More than one publisher, now or later (a file can grow)."""
        return self.file is not None or len(self.addresses) > 1

    def current(self) -> list[str]:
        """The addresses now (a file is read again)."""
        return list(self.addresses) if self.file is None else read_file(self.file)

    def describe(self) -> str:
        return self.spec


class FileWatch:
    """Re-reads an endpoints file when its mtime or size changes. A file that breaks
    (a bad line, removed while rewritten) is logged and the last good list kept. A new
    list is taken once it has stayed the same for ``settle_s``: a file that keeps
    flipping between lists changes nothing until it settles (counted in ``flips``)."""

    def __init__(
        self,
        path: Path,
        settle_s: float = FILE_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.settle_s = settle_s
        self._clock = clock
        self._sig: tuple[int, int] | None = None
        self.addresses: list[str] = []
        self.flips = 0
        """New lists replaced by another before they settled."""
        self._next: tuple[list[str], float] | None = None  # a new list, and since when
        self._log = LogRate(per_s=0.1, burst=2)

    def changed(self) -> bool:
        """True when the list changed since the last call (read it in ``addresses``)."""
        now = self._clock()
        try:
            st = os.stat(self.path)
        except OSError as e:
            if self._sig is not None:
                log.warning("endpoints file %s: %s; keeping its last list", self.path, e)
                self._sig = None
            return False
        sig = (st.st_mtime_ns, st.st_size)
        if sig != self._sig:
            self._sig = sig
            try:
                new = read_file(self.path)
            except ConfigError as e:
                log.warning("%s; keeping the last good list of %d", e, len(self.addresses))
                return False
            if self._next is not None and self._next[0] != new:  # replaced unsettled
                self.flips += 1
                self._log.log(
                    log, logging.WARNING,
                    "endpoints file %s keeps changing (%d lists replaced before they "
                    "settled); keeping the %d publishers read now until one list stays %.0fs",
                    self.path, self.flips, len(self.addresses), self.settle_s,
                )  # fmt: skip
            if new == self.addresses:
                self._next = None
            elif self._next is None or self._next[0] != new:
                self._next = (new, now)
        if self._next is None or now - self._next[1] < self.settle_s:
            return False
        self.addresses, self._next = self._next[0], None
        return True

    def read_now(self) -> list[str]:
        """Take the file's list as it is now (at start: nothing to settle from)."""
        self.changed()
        if self._next is not None:
            self.addresses, self._next = self._next[0], None
        return self.addresses
