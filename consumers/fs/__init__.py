"""Filesystem sink and readers: the stream as sharded Arrow IPC files.

``FsSink`` writes a run; ``ActivationRun`` reads it (pyarrow dataset, per-request
lookup, manifest check); ``consumers.fs.torch_dataset.TokenDataset`` streams it to
PyTorch (imported from its module so that the sink does not need torch.utils.data).
"""

from consumers.fs.layout import UnsafePath
from consumers.fs.reader import ActivationRun, BadShard
from consumers.fs.reductions import Reduction, parse_reduction
from consumers.fs.sink import FsSink
from consumers.fs.writer import StorageError, WriterConfig

__all__ = [
    "ActivationRun",
    "BadShard",
    "FsSink",
    "Reduction",
    "StorageError",
    "UnsafePath",
    "WriterConfig",
    "parse_reduction",
]
