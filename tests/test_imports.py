"""The import stack, read from the source (nothing is imported): no circles, no upward
arrows. ``actbus`` is the core, in layers; ``consumers`` and ``trainers`` are plugins
on top of it, reached from the core only through entry points."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actbus", "consumers", "trainers")

# The core's layers, bottom first: a module imports only from its own layer or lower.
# Keys are module names or prefixes ending in "." (a package's modules); the longest match
# wins. A module of actbus named by none of them fails the test: place it when adding it.
LAYERS: dict[str, int] = {
    "actbus": 0,  # the package's own __init__: a docstring and the version
    "actbus.errors": 0,
    "actbus.streams": 0,
    "actbus.fields": 0,
    "actbus.logcap": 0,
    "actbus.flags": 0,
    "actbus.jsontext": 0,
    "actbus.request_ids": 0,
    "actbus.wire": 1,
    "actbus.ops": 1,  # the custom ops every feature's graph code calls
    "actbus.steps": 1,  # what a step tells the features
    "actbus.rowstore": 1,  # the returned rows' and scores' per-request stores
    "actbus.checkpoints": 1,  # the probe and SAE files: steering, monitors, trainers, precheck
    "actbus.experts": 1,  # expert load from router rows: actbus stats and the dashboards
    "actbus.client": 1,  # returned rows and scores out of an HTTP response, for callers
    "actbus.bus": 2,
    "actbus.bus.": 2,
    "actbus.collector": 2,  # what the returned rows' and scores' collectors share
    "actbus.config": 3,
    "actbus.steer": 3,  # the package's docstring
    "actbus.steer.config": 3,  # part of the engine's config
    "actbus.monitor": 3,  # the package's docstring
    "actbus.monitor.config": 3,  # part of the engine's config
    # The features: siblings that never import each other (FEATURES below).
    "actbus.capture": 4,
    "actbus.capture.": 4,
    "actbus.steer.": 4,
    "actbus.monitor.": 4,
    "actbus.hooks": 4,  # user hooks: the op and the worker side
    # The one seam to vLLM: composes the features.
    "actbus.engine": 5,
    "actbus.engine.": 5,
    "actbus.precheck": 5,  # read by actbus serve, and by the engine (foreign_sources)
    "actbus.tiny_models": 5,
    "actbus.consumer": 5,
    "actbus.serve": 6,
    "actbus.keys": 6,
    "actbus.run": 6,
    "actbus.cli": 6,
    # Inspect AI's provider (its entry point): loaded by Inspect, never by the engine.
    "actbus.inspect_provider": 6,
    "actbus.inspect_model": 6,
}
FEATURES = ("actbus.capture", "actbus.steer", "actbus.monitor", "actbus.hooks")
"""Siblings: what they share lives below them, and only ``actbus.engine`` composes them."""
VLLM_IMPORTERS = ("actbus.engine", "actbus.tiny_models")
"""The only modules of the three packages that may import vLLM (besides tests and
benchmarks, which are not packages)."""
# Which top-level package may import which (each may import itself).
ALLOWED = {
    "actbus": set(),
    "consumers": {"actbus"},
    "trainers": {"actbus", "consumers"},
}


def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(module imported, line) for every import in the file, at any depth (a function's
    lazy import is an arrow too), resolved to the modules of the three packages."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    # ``if TYPE_CHECKING:`` imports are annotations only, never run: not arrows.
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # ``from pkg import mod`` imports the module pkg.mod when there is one
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a package's name
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in known}
    for name, path in known.items():
        for target, line in imports(name, path, known):
            edges[name].setdefault(target, line)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> int | None:
    best = None
    for key, rank in LAYERS.items():
        hit = module == key or (key.endswith(".") and module.startswith(key))
        if hit and (best is None or len(key) > len(best[0])):
            best = (key, rank)
    return best[1] if best else None


def test_the_walk_sees_lazy_and_from_imports():
    """The walker itself: a function-level import, ``from pkg import module`` and a
    package's own modules are all found (a walker that saw none would pass below)."""
    edges = graph()
    assert "actbus.bus.protocol" in edges["actbus.bus"]  # the package re-exports it
    assert "actbus.ops" in edges["actbus.capture.taps"]  # from actbus import ops
    assert "actbus.engine.session" in edges["actbus.engine.plugin"]  # inside a function
    # policies name routing's types for annotations only (``if TYPE_CHECKING:``)
    assert "actbus.bus.routing" not in edges["actbus.bus.policies"]
    assert "actbus.bus.policies" in edges["actbus.bus.routing"]
    assert len(edges) > 60


def test_no_circles():
    found = circles(graph())
    assert not found, "import circles (each list imports itself round): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_no_upward_arrows_between_packages():
    bad = [
        f"{src} imports {dst} (line {line})"
        for src, targets in graph().items()
        for dst, line in targets.items()
        if (a := src.split(".")[0]) != (b := dst.split(".")[0]) and b not in ALLOWED[a]
    ]
    assert not bad, (
        "actbus reaches consumers and trainers only through entry points, and consumers "
        "never import trainers:\n  " + "\n  ".join(bad)
    )


def test_core_layers():
    edges = graph()
    core = [m for m in edges if m.split(".")[0] == "actbus"]
    unplaced = [m for m in core if layer(m) is None]
    assert not unplaced, f"place these modules in LAYERS of {__file__}: {unplaced}"
    bad = [
        f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)}), line {line}"
        for src in core
        for dst, line in edges[src].items()
        if dst.split(".")[0] == "actbus" and layer(dst) > layer(src)
    ]
    assert not bad, "the core imports only from its own layer or lower:\n  " + "\n  ".join(bad)


def feature_of(module: str) -> str | None:
    return next((f for f in FEATURES if module == f or module.startswith(f + ".")), None)


def crossings(edges: dict[str, dict[str, int]]) -> list[str]:
    """Imports from one feature package into another."""
    return [
        f"{src} imports {dst} (line {line})"
        for src, targets in edges.items()
        for dst, line in targets.items()
        if (a := feature_of(src)) and (b := feature_of(dst)) and a != b
    ]


def vllm_imports(name: str, source: str) -> list[int]:
    """Lines of ``source`` (module ``name``) that import vLLM at any depth, unless the
    module is one of ``VLLM_IMPORTERS``."""
    if any(name == m or name.startswith(m + ".") for m in VLLM_IMPORTERS):
        return []
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            lines.append(node.lineno)
    return lines


def test_features_never_import_each_other():
    bad = crossings(graph())
    assert not bad, (
        "capture, steer and monitor are siblings: move what they share below them, and "
        "compose them in actbus.engine:\n  " + "\n  ".join(bad)
    )


def test_only_the_engine_imports_vllm():
    bad = [
        f"{name} line {line}"
        for name, path in modules().items()
        for line in vllm_imports(name, path.read_text())
    ]
    assert not bad, "only actbus.engine touches vLLM; move these there:\n  " + "\n  ".join(bad)


def test_the_checks_catch_a_deliberate_violation():
    """Each rule flags a planted violation, so a rule that checks nothing fails here."""
    planted = {"actbus.capture.worker": {"actbus.monitor.worker": 7}, "actbus.steer.x": {}}
    assert crossings(planted) == ["actbus.capture.worker imports actbus.monitor.worker (line 7)"]
    assert crossings({"actbus.engine.session": {"actbus.monitor.worker": 3}}) == []
    lazy = "def f():\n    from vllm.v1 import x\n    import vllm\n"
    assert vllm_imports("actbus.steer.worker", lazy) == [2, 3]
    assert vllm_imports("actbus.engine.session", lazy) == []
    edges = graph()
    edges["actbus.wire"] = {**edges["actbus.wire"], "actbus.engine.session": 1}
    assert any(
        src == "actbus.wire" and layer(dst) > layer(src)
        for src, targets in edges.items()
        for dst in targets
    )
