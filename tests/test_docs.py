"""The README stays short and its links stay true.

MkDocs checks the pages under docs/ (``make docs``, ``--strict``); these files live
outside docs/, so their links are checked here: every relative link leads to a file
that exists, and every ``#anchor`` to a heading of the file it names.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 12 * 1024
CHECKED = ("README.md", "benchmarks/RESULTS.md")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code, where bracket-paren pairs are not links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = _prose(text)
    return _LINK.findall(prose) + _REF.findall(prose)


def _heading_text(raw: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # [text](url) -> text
    return text.replace("`", "").replace("*", "")


def mkdocs_slug(heading: str) -> str:
    """The id MkDocs (Python-Markdown's toc extension) gives a heading."""
    text = unicodedata.normalize("NFKD", _heading_text(heading))
    text = text.encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading of a Markdown file it renders."""
    text = _heading_text(heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Ids of the headings of ``path``: MkDocs' under docs/, GitHub's elsewhere."""
    slug = mkdocs_slug if ROOT / "docs" in path.parents else github_slug
    return {slug(m.group(2)) for m in _HEADING.finditer(_FENCE.sub("", path.read_text()))}


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` that leads nowhere, with the reason."""
    out = []
    for target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{target}: {os.path.relpath(dest, ROOT)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target}: no heading with the id #{anchor} in {dest.name}")
    return out


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size < README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: move the detail to a page under docs/"
    )


@pytest.mark.parametrize("name", CHECKED)
def test_relative_links_lead_somewhere(name: str) -> None:
    path = ROOT / name
    assert links(path.read_text()), f"{name} has no links: the link pattern is broken"
    assert broken_links(path) == [], f"{name} has broken links"


def test_the_checker_finds_broken_links(tmp_path: Path) -> None:
    """A missing file and a missing heading are both reported; fine links are not."""
    page = ROOT / "docs" / "index.md"
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n## Some `code` here\n\n"
        f"[ok]({page}) [ok](#some-code-here) [ok](https://example.org/x.md)\n"
        f"[gone](nowhere.md) [bad anchor]({page}#no-such-heading)\n"
        "`[not a link](in-code.md)`\n```\n[not a link](in-fence.md)\n```\n"
    )
    found = broken_links(doc)
    assert len(found) == 2, found
    assert "nowhere.md" in found[0] and "#no-such-heading" in found[1]


def test_slugs_match_mkdocs() -> None:
    assert mkdocs_slug("actbus run sae / probe") == "actbus-run-sae-probe"
    assert mkdocs_slug("W&B") == "wb"
    assert mkdocs_slug("`n > 1`") == "n-1"
    assert github_slug("Serve and train live") == "serve-and-train-live"


# ------------------------------------------------------------ repository paths
_TOP = "examples|benchmarks|tests|actbus|consumers|trainers|scripts"
_REPO_PATH = re.compile(
    rf"(?<![\w./-])((?:{_TOP})/(?:[\w.-]+/)*(?:[\w.-]*\w\.\w+\b|(?=[\s`)|,;:]|$)))", re.M
)
"""A repository path: a file with an extension (`examples/inspect_probe.py`,
`benchmarks/results/x.png`) or a directory ending in a slash (`consumers/fs/`) under a
top-level folder; not a URL's path (`/v1/actbus/vectors`), a placeholder (`actbus/MODEL`)
or a glob (`tests/gpu/check_*.py`)."""


def missing_paths(text: str) -> list[str]:
    """Repository files and directories a page names (in prose or code, e.g.
    `examples/x.py`) that do not exist: a user pastes them."""
    return sorted({p for p in _REPO_PATH.findall(text) if not (ROOT / p).exists()})


def test_every_repository_file_the_docs_name_exists() -> None:
    pages = [*(ROOT / name for name in CHECKED), *sorted((ROOT / "docs").rglob("*.md"))]
    gone = {str(p.relative_to(ROOT)): m for p in pages if (m := missing_paths(p.read_text()))}
    assert gone == {}, f"files named in the docs that do not exist: {gone}"
    named = {m for p in pages for m in _REPO_PATH.findall(p.read_text())}
    assert {"examples/inspect_probe.py", "consumers/fs/"} <= named, "the path pattern is broken"


def test_the_path_checker_finds_a_missing_file() -> None:
    text = (
        "see `examples/demo.py` and examples/no_such_example.py, not x/examples/y.py;\n"
        "examples/chat.jinja, `consumers/fs/`, `consumers/gone/`, `/v1/actbus/vectors/f12`,\n"
        "actbus/MODEL, `tests/gpu/check_*.py`"
    )
    assert missing_paths(text) == [
        "consumers/gone/",
        "examples/chat.jinja",
        "examples/no_such_example.py",
    ]


# ------------------------------------------------------------------ code blocks
def test_every_code_block_runs_or_is_marked_a_fragment() -> None:
    """Each Python and shell block of the README and docs/ is run by a test as pasted
    (``<!-- runs: ID -->``) or says why not (``<!-- fragment: REASON -->``)."""
    from tests.support.docs_blocks import RUN_BY, RUN_LANGS, all_blocks

    blocks = [b for b in all_blocks() if b.lang in RUN_LANGS]
    assert len(blocks) > 40, "the block parser found too few blocks"
    unmarked = [b.where for b in blocks if b.kind is None]
    assert unmarked == [], (
        "blocks neither run nor marked: add <!-- runs: ID --> (and a test) or "
        "<!-- fragment: REASON --> on the line above each (docs/development.md)"
    )
    vague = [b.where for b in blocks if b.kind == "fragment" and len(b.arg.split()) < 3]
    assert vague == [], "a fragment's reason says why it is not run, in a few words"
    ids = [b.arg for b in blocks if b.kind == "runs"]
    assert sorted(ids) == sorted(set(ids)), "a runs: id names one block"
    assert set(ids) == set(RUN_BY), "every runs: id has its test in RUN_BY, and back"
    readme = [b for b in blocks if b.path.name == "README.md"]
    assert {b.arg for b in readme if b.kind == "runs"} >= {
        "readme-serve",
        "readme-steer-python",
        "readme-steer-http",
        "readme-store",
    }


def test_the_block_checker_finds_unmarked_blocks(tmp_path: Path) -> None:
    from tests.support.docs_blocks import parse

    doc = tmp_path / "doc.md"
    doc.write_text(
        "# T\n\n<!-- runs: x -->\n```bash\necho 1\n```\n\n"
        "<!-- fragment: needs a GPU -->\n```python\nimport torch\n```\n\n"
        "```python\nprint(1)\n```\n\n```text\nout\n```\n"
    )
    found = [(b.lang, b.kind, b.arg, b.code) for b in parse(doc)]
    assert found == [
        ("bash", "runs", "x", "echo 1\n"),
        ("python", "fragment", "needs a GPU", "import torch\n"),
        ("python", None, "", "print(1)\n"),
        ("text", None, "", "out\n"),
    ]


def test_the_readmes_output_directories_are_git_ignored() -> None:
    """What the README's blocks write (out/, runs/, wandb/) never shows in git status."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("out/saes", "runs/today", "wandb/offline-run-1"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, timeout=30)
        assert r.returncode == 0, f"{path} is not git-ignored (.gitignore)"


# docs/development.md's module map: the rows of the tables under its "Modules" heading
# name modules by their path from the repository root.
_MODULE_CELL = re.compile(r"`((?:actbus|consumers|trainers)/[\w/]+\.py)`")


def mapped_modules(text: str) -> set[str]:
    """Module paths named in the first column of the tables under ``## Modules``."""
    section = (
        text.split("\n## Modules", 1)[-1].split("\n## ", 1)[0] if "\n## Modules" in text else ""
    )
    out: set[str] = set()
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = line.split("|")
            if len(cells) > 2:
                out.update(_MODULE_CELL.findall(cells[1]) + _MODULE_CELL.findall(cells[2]))
    return out


def package_modules(root: Path) -> set[str]:
    """Every module of the three packages (package ``__init__`` files included only
    when they hold more than a docstring)."""
    out = set()
    for pkg in ("actbus", "consumers", "trainers"):
        for p in (root / pkg).rglob("*.py"):
            if p.name == "__init__.py" and len(p.read_text().strip().splitlines()) <= 12:
                continue
            out.add(p.relative_to(root).as_posix())
    return out


def test_the_module_map_is_the_tree() -> None:
    """docs/development.md names every module, and none that is gone."""
    mapped = mapped_modules((ROOT / "docs" / "development.md").read_text())
    actual = package_modules(ROOT)
    assert not actual - mapped, f"add to docs/development.md's Modules: {sorted(actual - mapped)}"
    assert not mapped - actual, f"gone from the tree: {sorted(mapped - actual)}"


def test_the_module_map_check_finds_a_missing_module(tmp_path: Path) -> None:
    for rel in ("actbus/engine/session.py", "actbus/wire.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text('"""x"""\n')
    text = (
        "# x\n\n## Modules\n\n| layer | module | holds |\n|---|---|---|\n"
        "| 1 | `actbus/wire.py` | frames |\n\n## Tests\n| 0 | `actbus/old.py` | x |\n"
    )
    assert mapped_modules(text) == {"actbus/wire.py"}
    assert package_modules(tmp_path) - mapped_modules(text) == {"actbus/engine/session.py"}
