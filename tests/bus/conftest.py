"""Fixtures of the bus tests: each test binds its own publisher at a fresh ipc path."""

from __future__ import annotations

import pytest


@pytest.fixture
def address(tmp_path) -> str:
    return f"ipc://{tmp_path}/bus.sock"
