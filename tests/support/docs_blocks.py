"""The code blocks of the README and docs/, and how the suite runs them.

Each ``python``/``bash``/``sh``/``shell``/``console`` block is preceded by one marker
line, an HTML comment (invisible on GitHub and on the MkDocs site):

- ``<!-- runs: ID -->``: a test runs it as pasted; ``RUN_BY[ID]`` names that test;
- ``<!-- fragment: REASON -->``: not run, and why (it needs GPUs, it is one step of a
  longer listing, it runs until Ctrl-C...).

``tests/test_docs.py`` fails on a block with neither. The shell blocks run against the
suite's shared ``actbus serve`` (``tests/test_journeys.py``), with the substitutions
``shell_script`` applies: that server's address, port and model in place of the
README's, and its own start left out (it is already up). A block whose server is its
own (``own_server_script``) runs whole, on a port of the test's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_LANGS = frozenset({"python", "py", "bash", "sh", "shell", "console"})
"""Blocks in these languages run as pasted or are marked fragments; ``text``, ``json``
and ``toml`` blocks show output or data."""

RUN_BY = {
    "readme-serve": "tests/test_journeys.py::test_readme_serve_and_train",
    "readme-steer-python": "tests/test_journeys.py::test_readme_steer_in_python",
    "readme-steer-http": "tests/test_journeys.py::test_readme_steer_over_http",
    "readme-return-http": "tests/test_journeys.py::test_readme_rows_over_http",
    "readme-store": "tests/test_journeys.py::test_readme_store_and_replay",
    "datasets-read": "tests/test_journeys.py::test_readme_store_and_replay",  # its run
    "http-inspect": "tests/test_journeys.py::test_docs_inspect_eval",
    "dashboards-wandb-read": "tests/test_journeys.py::test_readme_serve_and_train",  # its run
    "security-keys": "tests/test_docs_run.py::test_security_keys",
    "moe-tiny-model": "tests/test_docs_run.py::test_moe_tiny_model",
}
"""Every ``runs:`` id, and the test that runs it."""

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*(runs|fragment):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    kind: str | None  # "runs", "fragment" or None (unmarked)
    arg: str  # the id, or the reason
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, each with the marker on the line just above it."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        marker = _MARKER.match(lines[start - 1]) if start else None
        out.append(
            Block(
                path=path,
                line=start + 1,
                lang=lang,
                kind=marker.group(1) if marker else None,
                arg=marker.group(2) if marker else "",
                code="\n".join(lines[start + 1 : j]) + "\n",
            )
        )
        i = j + 1
    return out


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for path in documents() for b in parse(path)]


def block(block_id: str) -> Block:
    """The block marked ``<!-- runs: block_id -->``."""
    (found,) = [b for b in all_blocks() if b.kind == "runs" and b.arg == block_id]
    return found


_SERVE = re.compile(r"^actbus serve (?:.*\\\n)*.*$", re.M)


def shell_script(code: str, *, address: str, port: int, venv: Path) -> str:
    """A README shell block, to run against the suite's server: its ``actbus serve``
    (already up) left out, that server's bus address and port for the README's, the
    suite's venv for ``.venv``."""
    code = _SERVE.sub(": actbus serve, left out: the suite shares one server", code)
    code = code.replace(". .venv/bin/activate", f". {venv}/bin/activate")
    code = code.replace("ipc:///tmp/actbus.sock", address)
    return code.replace("localhost:8000", f"127.0.0.1:{port}")


def own_server_script(code: str, *, port: int) -> str:
    """A block that starts its own ``actbus serve`` on port 8000, as pasted but on
    ``port`` of the loopback interface (the suite binds no other)."""
    for old in ("--port 8000", "localhost:8000"):
        if old not in code:
            raise ValueError(f"the block has no {old!r} to put the test's port in")
    code = code.replace("--port 8000", f"--host 127.0.0.1 --port {port}")
    return code.replace("localhost:8000", f"127.0.0.1:{port}")


def command(code: str, start: str) -> str:
    """The command of ``code`` that begins with ``start``, with its continuation lines."""
    m = re.search(rf"^{re.escape(start)}(?:.*\\\n)*.*$", code, re.M)
    if m is None:
        raise ValueError(f"no command starting {start!r} in the block")
    return m.group(0)
