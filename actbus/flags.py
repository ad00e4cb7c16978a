"""Command-line flags made from dataclass fields, and the value types they share.

An options or config dataclass is the one place its flags are written: the field's
name gives the flag (``window_mb`` -> ``--window-mb``), its type and default give the
argparse type and default, its docstring gives the help, and ``metadata`` adds what
these cannot say (``flag(...)`` below). A new field is one line, and a flag's name, type
and help cannot drift from the field behind it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping
from functools import cache
from typing import Any

FLAG = "actbus.flag"  # the metadata key flag() writes
TYPED = "_typed_flags"  # the namespace attribute: {dest: the spelling the user typed}


class _StoreTyped(argparse._StoreAction):
    """``store``, and which of the flag's spellings was typed (``--layer`` or
    ``--layers``), so an error names the flag as the user wrote it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        if option_string:
            typed = dict(getattr(namespace, TYPED, None) or {})
            typed[self.dest] = option_string
            setattr(namespace, TYPED, typed)


def int_list(text: str) -> list[int]:
    """``--layers 0,3``: comma-separated integers (argparse names the flag on error)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, e.g. 0,3; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def float_list(text: str) -> list[float]:
    """``--lr 1e-3,3e-4``: comma-separated numbers."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        msg = f"expected comma-separated numbers, e.g. 1e-3,3e-4; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def str_list(text: str) -> list[str]:
    """``--hooks post_block,mlp_out``: comma-separated names."""
    return [v.strip() for v in text.split(",") if v.strip()]


_LISTS: dict[type, Callable[[str], list[Any]]] = {int: int_list, float: float_list, str: str_list}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in ``--help``, except where there is none to show (None, a
    switch) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default == "" or action.nargs == 0 or "default" in text:
            return text
        if isinstance(action.default, (list, tuple)):  # as typed: 16 or post_block,mlp_out
            return f"{text} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)


def flag(*option_strings: str, sweep: bool = False, **argparse_kw: Any) -> dict[str, Any]:
    """Field metadata for what a field's type and docstring cannot say.

    ``option_strings``: the flags, when not ``--field-name`` (the first is shown);
    ``sweep``: takes a comma-separated list, one config per value (``--k 32,64``);
    anything else goes to ``add_argument`` (``choices``, ``metavar``, ``type``...).
    Use as ``field(default=..., metadata=flag(...))``.
    """
    return {FLAG: {"flags": option_strings, "sweep": sweep, "kw": argparse_kw}}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of a dataclass's fields (the string after each one), flattened to
    one line each, ``code`` marks dropped; empty where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            text = " ".join(after.value.value.split()).replace("``", "")
            docs[node.target.id] = text
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            docs = {**field_docs(base), **docs}
    return docs


def option_name(name: str) -> str:
    """A field's flag: ``window_mb`` -> ``--window-mb``."""
    return "--" + name.replace("_", "-")


_NO_SPEC = flag()[FLAG]


def _spec(f: dataclasses.Field) -> dict[str, Any]:
    return f.metadata.get(FLAG, _NO_SPEC)


def _base(hint: Any) -> Any:
    """The type a value of the flag has: ``int | None`` -> ``int``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def flag_fields(cls: type, *, only: Collection[str] | None = None, exclude: Collection[str] = ()):
    """The fields of ``cls`` that become flags, in declaration order."""
    return [
        f
        for f in dataclasses.fields(cls)
        if f.init and (only is None or f.name in only) and f.name not in exclude
    ]


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    required: Collection[str] = (),
) -> None:
    """One flag per field of dataclass ``cls`` (``only`` these, none of ``exclude``).

    ``defaults`` replaces a field's default for this command; a ``required`` flag has
    none. The namespace gets each value under the field's own name.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = defaults or {}
    for f in flag_fields(cls, only=only, exclude=exclude):
        spec = _spec(f)
        hint = _base(hints[f.name])
        default = defaults.get(f.name, _default(f))
        names = spec["flags"] or (option_name(f.name),)
        help_text = docs.get(f.name, "")
        kw: dict[str, Any] = {"dest": f.name, "default": default}
        if hint is bool:
            if default:  # a flag that turns it off
                names = spec["flags"] or (option_name(f"no_{f.name}"),)
                help_text = f"turn off: {help_text[:1].lower()}{help_text[1:]}" if help_text else ""
                kw.update(action="store_false", default=True)
            else:
                kw.update(action="store_true", default=False)
        elif typing.get_origin(hint) is tuple:
            kw["type"] = _LISTS.get(typing.get_args(hint)[0], str_list)
            help_text = f"{help_text} (comma-separated)".strip()
        elif spec["sweep"]:
            kw["type"] = _LISTS.get(hint, str_list)
            kw["default"] = None if default is None else [default]
            help_text = f"{help_text} (comma-separated: one config per value)".strip()
        elif hint in (int, float, str):
            kw["type"] = hint
        kw.update(spec["kw"])
        if len(names) > 1 and "action" not in kw:
            kw["action"] = _StoreTyped
        if f.name in required:
            kw["required"] = True
            kw.pop("default", None)
        kw["help"] = help_text.replace("%", "%%")
        parser.add_argument(*names, **kw)


def sweeps(cls: type) -> list[str]:
    """The fields of ``cls`` whose flag takes several values (``flag(sweep=True)``)."""
    return [f.name for f in dataclasses.fields(cls) if _spec(f)["sweep"]]


def values(
    ns: argparse.Namespace,
    cls: type,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
) -> dict[str, Any]:
    """The values ``add_fields`` put in ``ns``, by field name; lists of a tuple-typed
    field become tuples."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in flag_fields(cls, only=only, exclude=exclude):
        v = getattr(ns, f.name)
        if isinstance(v, list) and typing.get_origin(_base(hints[f.name])) is tuple:
            v = tuple(v)
        out[f.name] = v
    return out


_FIELD = re.compile(r"^(?:\w+\.)?(--[\w-]+|\w+)(\[\d+\])?:")


def name_flag(
    parser: argparse.ArgumentParser, message: str, ns: argparse.Namespace | None = None
) -> str:
    """A config's error, with the field (or flag) it starts with replaced by the flag as
    the user typed it (``ns``: the parsed namespace; else the flag's first spelling):
    ``"k: expected 1..d_sae"`` -> ``"--k: expected 1..d_sae"``; ``"--hooks[0]: unknown
    hook"`` after ``--hook post_blok`` -> ``"--hook: unknown hook"`` (the index only
    where several values were given)."""
    m = _FIELD.match(message)
    if not m:
        return message
    name, index = m.group(1), m.group(2) or ""
    for action in parser._actions:
        if action.option_strings and (action.dest == name or name in action.option_strings):
            typed = (getattr(ns, TYPED, None) or {}).get(action.dest) if ns else None
            value = getattr(ns, action.dest, None) if ns else None
            if isinstance(value, (list, tuple)) and len(value) == 1:
                index = ""  # one value: its flag says which
            return (typed or action.option_strings[0]) + index + message[m.end() - 1 :]
    return message
