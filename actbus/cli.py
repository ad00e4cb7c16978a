"""The ``actbus`` command: a dispatcher over the ``actbus.commands`` entry points.

Each command is registered under that group (pyproject.toml) as a ``main(argv) ->
int`` whose docstring's first line is its one-line description; this module only
lists them and hands one the rest of the line. So the core names no plugin package:
``actbus dashboard`` and ``actbus replay`` live with their consumers.

    actbus COMMAND [ARGS...]
    actbus --help
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

GROUP = "actbus.commands"


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
    return int(cmds[name].load()(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
