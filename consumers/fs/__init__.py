"""Filesystem sink and reader: the stream as sharded Arrow IPC files."""

from consumers.fs.reader import ActivationRun
from consumers.fs.sink import FsSink

__all__ = ["ActivationRun", "FsSink"]
