"""The ``actbus`` command: a dispatcher over the ``actbus.commands`` entry points.

Each command is registered under that group (pyproject.toml) as a ``main(argv) ->
int`` whose docstring's first line is its one-line description; this module only
lists them and hands one the rest of the line. So the core names no plugin package:
``actbus dashboard`` and ``actbus replay`` live with their consumers.

    actbus COMMAND [ARGS...]
    actbus --help
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping
from importlib.metadata import EntryPoint, entry_points

GROUP = "actbus.commands"
ENGINE_COMMANDS = ("serve",)
"""Commands that start vLLM, which sizes its own CPU thread pools: their environment is
left as the user gave it."""
QUIET_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}
"""What every other command's process runs with unless the user set it: idle OpenMP
workers sleep instead of spinning (``quiet_openmp``)."""


def quiet_openmp(environ: MutableMapping[str, str]) -> None:
    """Let torch's idle CPU workers sleep: actbus's processes run beside an engine.

    GNU OpenMP, torch's CPU thread pool on Linux, keeps every idle worker spinning for a
    while after each parallel op: on this project's 2-core CI machine 5.6 ms of a core per
    worker per op, and a pool is as wide as the machine. Beside vLLM those are bursts on
    every core, the ones its step loop needs too (vLLM trims its own pools for the same
    reason). Must be in the environment before torch is imported; values the user set
    are kept.
    """
    for key, value in QUIET_OPENMP.items():
        environ.setdefault(key, value)


def consumer_command(name: str, address: str, *flags: str) -> list[str]:
    """The argv that starts consumer ``name`` as its own process, as a user would."""
    return [sys.executable, "-m", "actbus.cli", "run", name, "--connect", address, *flags]


def commands() -> dict[str, EntryPoint]:
    """The registered commands, by name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def describe(main: Callable[[list[str]], int]) -> str:
    """A command's one-line description: the first line of its ``main``'s docstring."""
    return ((main.__doc__ or "").strip().splitlines() or [""])[0]


def usage(cmds: dict[str, EntryPoint]) -> str:
    lines = [
        "usage: actbus COMMAND [ARGS...]",
        "",
        "A streaming activation bus for vLLM: capture the residual stream while serving and "
        "publish it over ZeroMQ.",
        "",
        "commands:",
    ]
    for name, ep in sorted(cmds.items()):
        try:
            text = describe(ep.load())
        except Exception as e:  # a broken plugin is listed, not fatal to --help
            text = f"(cannot load {ep.value}: {type(e).__name__}: {e})"
        lines.append(f"  {name:11s} {text}")
    lines += ["", "`actbus COMMAND --help` shows a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = commands()
    if not cmds:
        print(
            f"actbus: no commands are registered (entry-point group {GROUP}); install actbus "
            "(pip install -e .) or run scripts/register_entry_points.py DIR with DIR on "
            "PYTHONPATH",
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(cmds), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in cmds:
        print(
            f"actbus: unknown command {name!r}; choose one of {', '.join(sorted(cmds))} "
            "(actbus --help)",
            file=sys.stderr,
        )
        return 2
    if name not in ENGINE_COMMANDS and "torch" not in sys.modules:  # else too late to matter
        quiet_openmp(os.environ)
    return int(cmds[name].load()(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
