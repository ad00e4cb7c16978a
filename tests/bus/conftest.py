"""Fixtures of the bus tests: each test binds its own publisher at a fresh ipc path."""

from __future__ import annotations

import pytest


@pytest.fixture
def address(tmp_path) -> str:
    return f"ipc://{tmp_path}/bus.sock"


@pytest.fixture(params=["shm", "socket"])
def bus_path(request, monkeypatch) -> str:
    """Run a test over both data paths: its subscribers, in this process and in the
    processes it starts, read rows from the publisher's shared memory, or from the
    socket (``ACTBUS_SHM=0``, as a subscriber on another host does)."""
    monkeypatch.setenv("ACTBUS_SHM", "1" if request.param == "shm" else "0")
    return request.param
