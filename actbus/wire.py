"""The wire format: what one activation message looks like on the bus.

A data message is two frames: a small msgpack header and the raw tensor bytes.
The tensor frame is sent zero-copy and never pickled; its dtype and shape are in
the header. Row metadata (which request, which position, which token) travels in
the header as a per-step request table plus packed int arrays, so a message for
8k rows costs a few tens of KiB of header, not 8k msgpack strings.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

SCHEMA_VERSION = 1

# Frame tags: the first frame of every message names its kind.
DATA = b"D"  # publisher -> subscriber: seq (u64), header, tensor
HEARTBEAT = b"H"  # publisher -> subscriber: status header
END = b"E"  # publisher -> subscriber: the publisher is shutting down
WELCOME = b"W"  # publisher -> subscriber: reply to HELLO
REJECT = b"X"  # publisher -> subscriber: the HELLO was refused (reason in header)
HELLO = b"O"  # subscriber -> publisher: subscription request
CREDIT = b"C"  # subscriber -> publisher: grant more messages (also a heartbeat)
BYE = b"B"  # subscriber -> publisher: leaving
STATS = b"S"  # subscriber -> publisher: ask for the publisher's counters; and the reply
KEEPALIVE = b"K"  # subscriber side socket -> publisher: {"of": subscriber identity}, alive
MARK = b"M"  # subscriber -> publisher -> every subscriber: a request is worth keeping

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class WireError(ValueError):
    """A message that does not follow the schema (malformed, truncated, wrong version)."""


@dataclass
class RowIndex:
    """Which request, position and token each row of a step belongs to.

    Rows are grouped by request in batch order: rows ``offsets[i]:offsets[i+1]``
    belong to ``request_ids[i]``.
    """

    request_ids: list[str]
    offsets: np.ndarray  # int64 [n_requests + 1]
    positions: np.ndarray  # int64 [n_rows]
    token_ids: np.ndarray  # int64 [n_rows]
    sample_index: list[int] = field(default_factory=list)
    """Per request: the child index of an ``n > 1`` request, else 0 (empty: all 0)."""
    tags: list[dict[str, Any]] = field(default_factory=list)
    """Per request: the free-form tags of its selection (empty: no tags)."""
    returned: list[bool] = field(default_factory=list)
    """Per request: whether its caller asked for its activations back (``return``);
    the front end's own subscriber keeps only those (empty: none did)."""
    _wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    """``to_wire``'s result, kept: one step's messages share one index."""

    @classmethod
    def empty(cls) -> RowIndex:
        z = np.zeros(0, dtype=np.int64)
        return cls(request_ids=[], offsets=np.zeros(1, dtype=np.int64), positions=z, token_ids=z)

    def request_tags(self, i: int) -> dict[str, Any]:
        return self.tags[i] if self.tags else {}

    def request_sample_index(self, i: int) -> int:
        return self.sample_index[i] if self.sample_index else 0

    def request_returned(self, i: int) -> bool:
        return bool(self.returned[i]) if self.returned else False

    def select(self, keep: list[int]) -> tuple[RowIndex, np.ndarray]:
        """The index of requests ``keep`` only, and the row numbers it keeps (for
        slicing the tensor): how a subscriber's filter cuts a message down."""
        counts = np.diff(self.offsets)
        starts = self.offsets[:-1]
        rows = (
            np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in keep])
            if keep
            else np.zeros(0, dtype=np.int64)
        ).astype(np.int64)
        sub = RowIndex(
            request_ids=[self.request_ids[i] for i in keep],
            offsets=np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64),
            positions=self.positions[rows],
            token_ids=self.token_ids[rows],
            sample_index=[self.sample_index[i] for i in keep] if self.sample_index else [],
            tags=[self.tags[i] for i in keep] if self.tags else [],
            returned=[self.returned[i] for i in keep] if self.returned else [],
        )
        return sub, rows

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0

    def per_row(self, values: Sequence[Any] | np.ndarray) -> np.ndarray:
        """A per-request field (one entry per request, in ``request_ids`` order) as one
        entry per row: ``values[i]`` for rows ``offsets[i]:offsets[i+1]``.

        The one place where request fields become row columns (the fs sink's rows,
        the trainers' rows). A numpy array keeps its dtype and trailing dimensions
        (per-request label vectors give a label matrix); any other sequence gives an
        object array of the very objects given, so a request's tags dict is shared
        by its rows, not copied."""
        counts = np.diff(self.offsets)
        if len(values) != len(counts):
            raise ValueError(f"per_row: {len(values)} values for {len(counts)} requests")
        if not isinstance(values, np.ndarray):
            objects = np.empty(len(values), dtype=object)
            for i, v in enumerate(values):  # item by item: a dict or list stays one entry
                objects[i] = v
            values = objects
        return np.repeat(values, counts, axis=0)

    def row_request_ids(self) -> list[str]:
        """The request id of every row."""
        return self.per_row(self.request_ids).tolist()

    def row_sample_index(self) -> np.ndarray:
        """The sample index (int32) of every row's request."""
        n = len(self.request_ids)
        return self.per_row(np.asarray(self.sample_index or [0] * n, dtype=np.int32))

    def row_tags(self) -> list[dict[str, Any]]:
        """The tags of every row's request (one dict per request, shared by its rows)."""
        return self.per_row([self.request_tags(i) for i in range(len(self.request_ids))]).tolist()

    def to_wire(self) -> dict[str, Any]:
        """Made once (the index is not changed after it is first encoded)."""
        if self._wire is None:
            self._wire = {
                "request_ids": self.request_ids,
                "sample_index": self.sample_index,
                "tags": self.tags,
                "returned": self.returned,
                "offsets": _pack_ints(self.offsets),
                "positions": _pack_ints(self.positions),
                "token_ids": _pack_ints(self.token_ids),
            }
        return self._wire

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RowIndex:
        try:
            rows = cls(
                request_ids=[str(r) for r in d["request_ids"]],
                offsets=_unpack_ints(d["offsets"]),
                positions=_unpack_ints(d["positions"]),
                token_ids=_unpack_ints(d["token_ids"]),
                sample_index=[int(i) for i in d.get("sample_index") or []],
                tags=[dict(t) for t in d.get("tags") or []],
                returned=[bool(r) for r in d.get("returned") or []],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"bad row index in header: {e}") from e
        n = rows.num_rows
        if len(rows.offsets) != len(rows.request_ids) + 1:
            raise WireError("row index: offsets must have one more entry than request_ids")
        for name in ("sample_index", "tags", "returned"):
            if getattr(rows, name) and len(getattr(rows, name)) != len(rows.request_ids):
                raise WireError(f"row index: {name} must have one entry per request")
        if len(rows.positions) != n or len(rows.token_ids) != n:
            raise WireError("row index: positions/token_ids length differs from the row count")
        off = rows.offsets
        if len(off) and (off[0] != 0 or bool((off[1:] < off[:-1]).any())):
            raise WireError("row index: offsets must start at 0 and never decrease")
        return rows


def _pack_ints(a: np.ndarray) -> bytes:
    """Little-endian int32: positions, token ids and row offsets all fit."""
    a = np.asarray(a)
    if a.size and (a.min() < -(1 << 31) or a.max() >= 1 << 31):
        raise ValueError("value does not fit the wire's int32 arrays")
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def _unpack_ints(b: bytes) -> np.ndarray:
    if not isinstance(b, (bytes, bytearray)) or len(b) % 4:
        raise ValueError("packed int array must be bytes of a multiple of 4")
    a = np.frombuffer(b, dtype="<i4").astype(np.int64)
    a.setflags(write=False)  # decoded indexes are shared between messages
    return a


@dataclass(frozen=True)
class RequestEnd:
    """A request that finished or was aborted; its rows so far are all it will get."""

    request_id: str
    sample_index: int
    reason: str  # "stop" | "length" | "abort" | "error" | "unknown"

    @property
    def complete(self) -> bool:
        """False when the request was cut short: its data is partial."""
        return self.reason in ("stop", "length")


@dataclass
class Header:
    """Everything about one data message except the tensor bytes."""

    step: int
    layer: int
    hook: str
    dtype: str
    shape: tuple[int, ...]
    model: str
    rows: RowIndex
    tags: dict[str, Any] = field(default_factory=dict)
    ended: list[RequestEnd] = field(default_factory=list)
    """Requests that left the engine since the previous step, with the reason; sent
    on every (layer, hook) message of the step (a step with no rows still sends it)."""
    schema: int = SCHEMA_VERSION

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "schema": self.schema,
                "step": self.step,
                "layer": self.layer,
                "hook": self.hook,
                "dtype": self.dtype,
                "shape": list(self.shape),
                "model": self.model,
                "tags": self.tags,
                "ended": [[e.request_id, e.sample_index, e.reason] for e in self.ended],
                "rows": self.rows.to_wire(),
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Header:
        d = unpack_map(raw)
        schema = d.get("schema")
        if schema != SCHEMA_VERSION:
            raise WireError(
                f"schema version {schema!r} is not supported (this actbus speaks "
                f"{SCHEMA_VERSION}); upgrade the older side"
            )
        try:
            hdr = cls(
                step=int(d["step"]),
                layer=int(d["layer"]),
                hook=str(d["hook"]),
                dtype=str(d["dtype"]),
                shape=tuple(int(s) for s in d["shape"]),
                model=str(d["model"]),
                tags=dict(d.get("tags") or {}),
                ended=[RequestEnd(str(r), int(i), str(w)) for r, i, w in d.get("ended") or []],
                rows=_rows_from_wire(d["rows"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, WireError):
                raise
            raise WireError(f"bad header field: {e!r}") from e
        if hdr.dtype not in DTYPES:
            raise WireError(f"unknown dtype {hdr.dtype!r}; expected one of {sorted(DTYPES)}")
        if len(hdr.shape) != 2 or hdr.shape[0] != hdr.rows.num_rows:
            raise WireError(f"shape {hdr.shape} does not match {hdr.rows.num_rows} rows")
        return hdr

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


_last_rows: tuple[Any, RowIndex] | None = None


def _rows_from_wire(d: Any) -> RowIndex:
    """Every (layer, hook) message of a step carries the same row index: it is
    decoded once and shared (its arrays are read-only), which took a third of a
    subscriber's work per message off (eight taps a step, sixteen requests)."""
    global _last_rows
    last = _last_rows  # one read: another thread's decode may replace it meanwhile
    if last is not None and last[0] == d:
        return last[1]
    rows = RowIndex.from_wire(d)
    _last_rows = (d, rows)
    return rows


def unpack_map(raw: bytes | memoryview) -> dict[str, Any]:
    """Decode a msgpack map, turning every decoding failure into a WireError."""
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"undecodable msgpack: {type(e).__name__}") from e
    if not isinstance(d, dict):
        raise WireError("header is not a map")
    return d


def pack_seq(seq: int) -> bytes:
    """Per-subscriber sequence number; a gap means messages were dropped."""
    return seq.to_bytes(8, "little")


def unpack_seq(raw: bytes | memoryview) -> int:
    if len(raw) != 8:
        raise WireError("sequence frame must be 8 bytes")
    return int.from_bytes(raw, "little")


def pack_map(d: dict[str, Any]) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def tensor_to_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor, for a zmq frame."""
    if t.device.type != "cpu":
        raise ValueError("tensor_to_frame needs a CPU tensor")
    if t.numel() == 0:  # a message with no rows (it still carries request ends)
        return memoryview(b"")
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def frame_to_tensor(buf: memoryview | bytes, hdr: Header) -> torch.Tensor:
    """The tensor of a data message, made zero-copy over the received frame."""
    if len(buf) != hdr.nbytes:
        raise WireError(f"tensor frame has {len(buf)} bytes, header says {hdr.nbytes}")
    if hdr.nbytes == 0:
        return torch.empty(hdr.shape, dtype=DTYPES[hdr.dtype])
    return torch.frombuffer(buf, dtype=DTYPES[hdr.dtype]).view(hdr.shape)


# zmq frames are read-only and consumers must not write into them; torch warns
# about that on every message. Silenced once here, for this module's calls only
# (a catch_warnings block per message cost more than the rest of the decode).
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)
