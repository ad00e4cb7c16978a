"""What ``--connect`` names: one publisher, or several (fan-in).

Three spellings, combinable where it makes sense:

- ``ADDR``: one publisher (``ipc:///tmp/actbus.sock``, ``tcp://HOST:5555``);
- ``A,B,C``: a list of addresses;
- a rank range in braces, ``ipc:///tmp/actbus-{0..3}.sock`` or
  ``tcp://HOST:{5555..5558}``: one address per integer, both ends included (one
  range per address; it may appear in a list item);
- ``@FILE``: a file listing endpoints, one per line (``#`` starts a comment, blank
  lines are skipped, lines may use ranges). The file is read again whenever it
  changes, so a fleet that scales up or down needs no restart of its subscribers.

Every address is checked as ``check_address`` checks it (errors name ``--connect``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from actbus.bus.addresses import check_address
from actbus.errors import ConfigError

log = logging.getLogger("actbus.endpoints")
MAX_ENDPOINTS = 1024
"""More publishers than this in one spec is a typo (a range of ports, say)."""
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand(item: str, *, field_name: str = "--connect") -> list[str]:
    """One address, or the addresses of its rank range, each checked."""
    ranges = _RANGE.findall(item)
    if len(ranges) > 1:
        raise ConfigError(f"{field_name}={item!r}: one {{A..B}} range per address, not several")
    if not ranges:
        if "{" in item or "}" in item:
            raise ConfigError(
                f"{field_name}={item!r}: a rank range is written {{FIRST..LAST}}, "
                "e.g. ipc:///tmp/actbus-{0..3}.sock"
            )
        return [check_address(item, field_name=field_name, allow_remote=True)]
    lo, hi = (int(x) for x in ranges[0])
    if hi < lo:
        raise ConfigError(f"{field_name}={item!r}: the range {{{lo}..{hi}}} runs backwards")
    if hi - lo + 1 > MAX_ENDPOINTS:
        raise ConfigError(f"{field_name}={item!r}: at most {MAX_ENDPOINTS} publishers")
    return [
        check_address(_RANGE.sub(str(i), item), field_name=field_name, allow_remote=True)
        for i in range(lo, hi + 1)
    ]


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
    """The endpoints listed in ``path`` (errors name the file and line)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"{field_name}=@{path}: cannot read the endpoints file: {e.strerror or e}"
        ) from None
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out += expand(line, field_name=f"{field_name}=@{path} line {n}")
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
        out = [a for item in items for a in expand(item, field_name=field_name)]
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
    (a bad line, removed while rewritten) is logged and the last good list kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sig: tuple[int, int] | None = None
        self.addresses: list[str] = []

    def changed(self) -> bool:
        """True when the list changed since the last call (read it in ``addresses``)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            if self._sig is not None:
                log.warning("endpoints file %s: %s; keeping its last list", self.path, e)
                self._sig = None
            return False
        sig = (st.st_mtime_ns, st.st_size)
        if sig == self._sig:
            return False
        self._sig = sig
        try:
            new = read_file(self.path)
        except ConfigError as e:
            log.warning("%s; keeping the last good list of %d", e, len(self.addresses))
            return False
        if new == self.addresses:
            return False
        self.addresses = new
        return True
