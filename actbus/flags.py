"""Command-line value types shared by actbus's commands and plugins."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """``--layers 0,3``: comma-separated integers (argparse names the flag on error)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, e.g. 0,3; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
