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
from itertools import chain
from typing import Any

import msgpack
import numpy as np
import torch

from actbus.logcap import capped
from actbus.streams import HOOKS, MAX_INT32, ROUTER_HOOK

SCHEMA_VERSION = 1

# Frame tags: the first frame of every message names its kind.
DATA = b"D"  # publisher -> subscriber: seq (u64), header, tensor
REGION = b"R"  # publisher -> local subscriber: seq, header, where the rows lie in its region
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
    """A message that does not follow the schema (malformed, truncated, wrong version,
    a field out of its bounds); ``field`` names the header field at fault."""

    def __init__(self, message: str, field: str = "message") -> None:
        super().__init__(message)
        self.field = field


# Bounds of a data message's header, checked at decode time on every subscriber: a
# consumer uses these fields as path parts (hook, layer), types (dtype), sizes
# (shape) and log text, so a buggy or hostile publisher's header is refused here,
# with the field named, before any consumer sees it. One message serves every
# request of a step, so the bounds are loose enough for anything capture accepts
# (tags of at most 4096 bytes encoded fit every tag bound).
MAX_INT64 = (1 << 63) - 1
MAX_MODEL_CHARS = 4096
MAX_REQUEST_ID_CHARS = 4096
MAX_REASON_CHARS = 64
MAX_PUBLISHER_ID_CHARS = 64
"""A publisher's run id (``Publisher.id`` is 32 hex digits)."""
MAX_REQUESTS = 1 << 16
"""Requests in one message's row index, and request ends in one header."""
MAX_TAG_CHARS = 4096
"""Characters of one tag key or string value."""
MAX_TAG_ITEMS = 4096
"""Keys of one request's tags (or of a header's own), and values in them all,
nested lists and maps included."""
MAX_TAG_DEPTH = 16

MONITOR_HOOK = "monitor"
"""The monitors' score hook: the hook name of a data message of float32 ``[rows, width]`` scores
whose header's ``monitor`` field names the monitor, its weights' version and its point
(``layer`` is the point's layer). Only subscribers that name this hook get them."""
KNOWN_HOOKS = frozenset(HOOKS) | {MONITOR_HOOK, ROUTER_HOOK}
"""The hook names a header may carry: the hook points capture taps, the router's, and
the monitors' score hook."""
NAMED_ONLY_HOOKS = frozenset({MONITOR_HOOK, ROUTER_HOOK})
"""Streams whose rows are not the residual stream's width (monitor scores; the router's
``[rows, 2 * top_k]`` float32 rows, ``actbus.router``): only a subscriber that names the
hook gets them, so a consumer of activations never receives rows of another width."""
MAX_MONITOR_NAME_CHARS = 200


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
    steer_versions: list[dict[str, int]] = field(default_factory=list)
    """Per request: the live steering vectors it steers with, each at the version it
    keeps from admission to its end (empty: no request of the message steers with one;
    absent from older publishers' headers)."""
    engine_ids: list[str] = field(default_factory=list)
    """Per request whose caller gets its rows or scores back (``returned``): vLLM's own
    id of that sample, unique where caller ids may repeat; ``""`` for the others. The
    front end's collectors match rows by it, so two requests that share a caller id
    never get each other's (empty: none returned; absent from older publishers'
    headers, which older decoders ignore)."""
    _wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    """``to_wire``'s result, kept: one step's messages share one index."""
    cuts: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The requests each subscriber filter keeps (``actbus.bus.routing``), kept for the
    same reason."""

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

    def keys(self) -> list[str]:
        """Per request, the id the front end's collectors file its rows under: vLLM's
        own id of a returned request, else (older publishers) the caller's."""
        if not self.engine_ids:
            return self.request_ids
        return [e or r for e, r in zip(self.engine_ids, self.request_ids, strict=True)]

    def request_steer_versions(self, i: int) -> dict[str, int]:
        return self.steer_versions[i] if self.steer_versions else {}

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
            steer_versions=[self.steer_versions[i] for i in keep] if self.steer_versions else [],
            engine_ids=[self.engine_ids[i] for i in keep] if self.engine_ids else [],
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
                **({"steer_versions": self.steer_versions} if self.steer_versions else {}),
                **({"engine_ids": self.engine_ids} if self.engine_ids else {}),
                "offsets": _pack_ints(self.offsets),
                "positions": _pack_ints(self.positions),
                "token_ids": _pack_ints(self.token_ids),
            }
        return self._wire

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RowIndex:
        """The index of a received header, every field checked against its bounds."""
        if type(d) is not dict:
            raise WireError(f"header field 'rows': {capped(d)} is not a map", "rows")
        try:
            ids = _list(d["request_ids"], "request_ids", MAX_REQUESTS)
            if set(map(type, ids)) - {str} or max(map(len, ids), default=0) > (
                MAX_REQUEST_ID_CHARS
            ):
                for r in ids:  # the one at fault, named
                    _str(r, "request_ids", MAX_REQUEST_ID_CHARS)
            sample_index = _list(d.get("sample_index") or [], "sample_index", MAX_REQUESTS)
            if (
                set(map(type, sample_index)) - {int}
                or not 0
                <= min(sample_index, default=0)
                <= max(sample_index, default=0)
                <= MAX_INT32
            ):
                for i in sample_index:
                    _int(i, "sample_index", 0, MAX_INT32)
            tags = _list(d.get("tags") or [], "tags", MAX_REQUESTS)
            if not _flat_tags_ok(tags):
                for t in tags:  # the one at fault, named
                    _tags(t, "tags")
            returned = _list(d.get("returned") or [], "returned", MAX_REQUESTS)
            if set(map(type, returned)) - {bool}:
                raise WireError("header field 'returned': entries must be booleans", "returned")
            steer_versions = _list(d.get("steer_versions") or [], "steer_versions", MAX_REQUESTS)
            for sv in steer_versions:
                _steer_versions(sv)
            engine_ids = _list(d.get("engine_ids") or [], "engine_ids", MAX_REQUESTS)
            for e in engine_ids:
                _str(e, "engine_ids", MAX_REQUEST_ID_CHARS)
            rows = cls(
                request_ids=ids,
                offsets=_unpack_ints(d["offsets"]),
                positions=_unpack_ints(d["positions"]),
                token_ids=_unpack_ints(d["token_ids"]),
                sample_index=sample_index,
                tags=tags,
                returned=returned,
                steer_versions=steer_versions,
                engine_ids=engine_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, WireError):
                raise
            raise WireError(f"bad row index in header: {capped(e)}", "rows") from e
        n = rows.num_rows
        if len(rows.offsets) != len(rows.request_ids) + 1:
            raise WireError(
                "row index: offsets must have one more entry than request_ids", "offsets"
            )
        for name in ("sample_index", "tags", "returned", "steer_versions", "engine_ids"):
            if getattr(rows, name) and len(getattr(rows, name)) != len(rows.request_ids):
                raise WireError(f"row index: {name} must have one entry per request", name)
        if len(rows.positions) != n or len(rows.token_ids) != n:
            raise WireError(
                "row index: positions/token_ids length differs from the row count", "positions"
            )
        off = rows.offsets
        if len(off) and (off[0] != 0 or bool((off[1:] < off[:-1]).any())):
            raise WireError("row index: offsets must start at 0 and never decrease", "offsets")
        return rows


def publisher_identity(welcome: dict[str, Any]) -> tuple[str | None, int | None]:
    """Who a WELCOME says its publisher is: its run (``publisher_id``, new at each
    start) and its data-parallel rank (``dp_rank``; absent before DP support, and from
    publishers that are no engine), each checked against its bound. The subscriber puts
    both on every batch and event it yields (``Source``), so the request ids of
    different ranks and runs are never confused."""
    pid = welcome.get("publisher_id")
    if pid is not None:
        _str(pid, "publisher_id", MAX_PUBLISHER_ID_CHARS)
    rank = welcome.get("dp_rank")
    if rank is not None:
        _int(rank, "dp_rank", 0, MAX_INT32)
    return pid, rank


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
    engine_id: str = ""
    """vLLM's own id of a request whose caller gets its rows or scores back (as in
    ``RowIndex.engine_ids``); ``""`` for the others."""

    @property
    def key(self) -> str:
        """The id the front end's collectors file this request under."""
        return self.engine_id or self.request_id

    @property
    def complete(self) -> bool:
        """False when the request was cut short: its data is partial."""
        return self.reason in ("stop", "length")


@dataclass(frozen=True)
class MonitorInfo:
    """Whose scores a monitor message carries: the monitor, the version of the weights
    that produced every score in it, and the hook of its point."""

    name: str
    version: int
    hook: str
    labels: tuple[int, ...] = ()
    """What each column scores: SAE latent indices; empty for a one-column probe."""

    def to_wire(self) -> list[Any]:
        return [self.name, self.version, self.hook, list(self.labels)]

    @classmethod
    def from_wire(cls, v: Any, width: int) -> MonitorInfo:
        if type(v) is not list or len(v) != 4:
            raise WireError(
                f"header field 'monitor': {capped(v)} is not [name, version, hook, labels]",
                "monitor",
            )
        name = _str(v[0], "monitor", MAX_MONITOR_NAME_CHARS, "name")
        if not name:
            raise WireError("header field 'monitor' name: empty", "monitor")
        version = _int(v[1], "monitor", 1, MAX_INT64, "version")
        hook = v[2]
        if type(hook) is not str or hook not in HOOKS:
            raise WireError(
                f"header field 'monitor' hook: {capped(hook)} is not one of {', '.join(HOOKS)}",
                "monitor",
            )
        labels = _list(v[3], "monitor", MAX_INT32)
        for x in labels:
            _int(x, "monitor", 0, MAX_INT32, "label")
        if labels and len(labels) != width:
            raise WireError(
                f"header field 'monitor' labels: {len(labels)} labels for {width} columns",
                "monitor",
            )
        return cls(name, version, hook, tuple(labels))


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
    monitor: MonitorInfo | None = None
    """Set exactly when ``hook`` is ``MONITOR_HOOK``."""
    schema: int = SCHEMA_VERSION

    def encode(self) -> bytes:
        extra = {"monitor": self.monitor.to_wire()} if self.monitor is not None else {}
        return msgpack.packb(
            {
                **extra,
                "schema": self.schema,
                "step": self.step,
                "layer": self.layer,
                "hook": self.hook,
                "dtype": self.dtype,
                "shape": list(self.shape),
                "model": self.model,
                "tags": self.tags,
                "ended": [[e.request_id, e.sample_index, e.reason] for e in self.ended],
                **_ended_engine_ids(self.ended),
                "rows": self.rows.to_wire(),
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Header:
        """A received header, every field a consumer uses checked against its bounds
        (``WireError`` names the field and the bound)."""
        d = unpack_map(raw)
        schema = d.get("schema")
        if schema != SCHEMA_VERSION:
            raise WireError(
                f"schema version {capped(schema)} is not supported (this actbus speaks "
                f"{SCHEMA_VERSION}); upgrade the older side",
                "schema",
            )
        try:
            hook = d["hook"]
            if type(hook) is not str or hook not in KNOWN_HOOKS:
                raise WireError(
                    f"header field 'hook': {capped(hook)} is not a known hook; expected one "
                    f"of {', '.join(sorted(KNOWN_HOOKS))}",
                    "hook",
                )
            dtype = d["dtype"]
            if type(dtype) is not str or dtype not in DTYPES:
                raise WireError(
                    f"header field 'dtype': {capped(dtype)} is not a known dtype; expected "
                    f"one of {', '.join(sorted(DTYPES))}",
                    "dtype",
                )
            shape = d["shape"]
            if type(shape) is not list or len(shape) != 2:
                raise WireError(
                    f"header field 'shape': {capped(shape)} is not [rows, width]", "shape"
                )
            hdr = cls(
                step=_int(d["step"], "step", 0, MAX_INT64),
                layer=_int(d["layer"], "layer", 0, MAX_INT32),
                hook=hook,
                dtype=dtype,
                shape=(
                    _int(shape[0], "shape", 0, MAX_INT32, "rows"),
                    _int(shape[1], "shape", 1, MAX_INT32, "width"),
                ),
                model=_str(d["model"], "model", MAX_MODEL_CHARS),
                tags=_tags(d.get("tags") or {}, "tags"),
                ended=_ends(d.get("ended") or [], d.get("ended_engine_ids")),
                rows=_rows_from_wire(d["rows"]),
            )
        except KeyError as e:
            raise WireError(f"bad header field: {capped(e.args[0])} is missing", "header") from e
        if hook == MONITOR_HOOK:
            if "monitor" not in d:
                raise WireError("header field 'monitor': missing on a monitor message", "monitor")
            if dtype != "float32":
                raise WireError(
                    f"header field 'dtype': monitor scores are float32, not {dtype}", "dtype"
                )
            hdr.monitor = MonitorInfo.from_wire(d["monitor"], hdr.shape[1])
        elif hook == ROUTER_HOOK and (dtype != "float32" or hdr.shape[1] % 2):
            raise WireError(
                f"header field 'dtype'/'shape': router rows are float32 [rows, 2 * top_k], "
                f"not {dtype} of width {hdr.shape[1]}",
                "shape",
            )
        elif "monitor" in d:
            raise WireError(
                f"header field 'monitor': set on a message of hook {hook!r}, not {MONITOR_HOOK!r}",
                "monitor",
            )
        if hdr.shape[0] != hdr.rows.num_rows:
            raise WireError(
                f"header field 'shape': {hdr.shape[0]} rows, the row index has {hdr.rows.num_rows}",
                "shape",
            )
        return hdr

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


# Field checks of a received header: each raises WireError naming the field.


def _int(v: Any, field: str, lo: int, hi: int, what: str = "") -> int:
    """``v`` if it is an int in ``[lo, hi]``; ``what`` names the part of ``field``."""
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        part = f" {what}" if what else ""
        raise WireError(
            f"header field {field!r}{part}: {capped(v)} is not an integer in [{lo}, {hi}]", field
        )
    return v


def _str(v: Any, field: str, limit: int, what: str = "") -> str:
    part = f" {what}" if what else ""
    if type(v) is not str:
        raise WireError(f"header field {field!r}{part}: {capped(v)} is not a string", field)
    if len(v) > limit:
        raise WireError(
            f"header field {field!r}{part}: {len(v)} characters, more than the {limit} allowed",
            field,
        )
    return v


MAX_STEER_VERSIONS = 64
"""Live vectors one request's ``steer_versions`` names, at most."""


def _steer_versions(v: Any) -> dict[str, int]:
    """One request's live steering vectors -> versions, bounded."""
    if type(v) is not dict or len(v) > MAX_STEER_VERSIONS:
        raise WireError(
            f"header field 'steer_versions': {capped(v)} is not a map of at most "
            f"{MAX_STEER_VERSIONS} names to versions",
            "steer_versions",
        )
    for k, n in v.items():
        _str(k, "steer_versions", MAX_MONITOR_NAME_CHARS, "name")
        _int(n, "steer_versions", 1, MAX_INT64, "version")
    return v


def _list(v: Any, field: str, limit: int) -> list[Any]:
    if type(v) is not list:
        raise WireError(f"header field {field!r}: {capped(v)} is not a list", field)
    if len(v) > limit:
        raise WireError(
            f"header field {field!r}: {len(v)} entries, more than the {limit} allowed", field
        )
    return v


def check_tags(v: Any, field: str) -> dict[str, Any]:
    """A request's tags as every subscriber will check them (``WireError`` if not):
    capture refuses a request whose tags would get its step's messages refused."""
    return _tags(v, field)


def _tags(v: Any, field: str) -> dict[str, Any]:
    """One tag map: string keys, JSON-like values, bounded in count, length and depth.
    Flat maps of short strings and numbers (the usual tags) are checked inline."""
    if type(v) is not dict:
        raise WireError(f"header field {field!r}: {capped(v)} is not a map", field)
    if len(v) > MAX_TAG_ITEMS:
        raise WireError(
            f"header field {field!r}: {len(v)} tags, more than the {MAX_TAG_ITEMS} allowed", field
        )
    budget = None
    for k, x in v.items():
        if type(k) is not str or len(k) > MAX_TAG_CHARS:
            _str(k, field, MAX_TAG_CHARS, "key")
        t = type(x)
        if t is str:
            if len(x) > MAX_TAG_CHARS:
                _str(x, field, MAX_TAG_CHARS, "value")
        elif x is not None and t not in _SCALARS:
            budget = budget or [MAX_TAG_ITEMS - len(v)]
            _tag_value(x, field, 1, budget)
    return v


_SCALARS = (bool, int, float)
_FLAT = {str, bool, int, float, type(None)}


def _flat_tags_ok(tags: list[Any]) -> bool:
    """True when every request's tags are a map of short string keys to short strings,
    numbers, booleans or None (the usual tags): checked in a few C-level passes over
    them all, where one check per map cost a microsecond each. False: look closer."""
    if not tags:
        return True
    if set(map(type, tags)) != {dict} or max(map(len, tags)) > MAX_TAG_ITEMS:
        return False
    keys = list(chain.from_iterable(tags))
    if not keys:
        return True
    if set(map(type, keys)) != {str} or max(map(len, keys)) > MAX_TAG_CHARS:
        return False
    values = list(chain.from_iterable(map(dict.values, tags)))
    kinds = set(map(type, values))
    if not kinds <= _FLAT:
        return False
    if str in kinds:
        strings = values if kinds == {str} else [v for v in values if type(v) is str]
        return max(map(len, strings)) <= MAX_TAG_CHARS
    return True


def _tag_value(v: Any, field: str, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise WireError(
            f"header field {field!r}: more than {MAX_TAG_ITEMS} values in one request's tags",
            field,
        )
    if v is None or type(v) in _SCALARS:
        return
    if type(v) is str:
        _str(v, field, MAX_TAG_CHARS, "value")
        return
    if type(v) not in (list, dict):  # bytes, extension types: not storable as JSON
        raise WireError(
            f"header field {field!r}: a value of type {type(v).__name__}; tags hold strings, "
            "numbers, booleans, lists and maps",
            field,
        )
    if depth >= MAX_TAG_DEPTH:
        raise WireError(f"header field {field!r}: nested deeper than {MAX_TAG_DEPTH}", field)
    if type(v) is dict:
        for k, x in v.items():
            _str(k, field, MAX_TAG_CHARS, "key")
            _tag_value(x, field, depth + 1, budget)
    else:
        for x in v:
            _tag_value(x, field, depth + 1, budget)


def _ended_engine_ids(ended: list[RequestEnd]) -> dict[str, list[str]]:
    """``ended_engine_ids``, beside ``ended`` (whose entries older decoders read as
    three items): present only when some ended request's caller gets data back."""
    ids = [e.engine_id for e in ended]
    return {"ended_engine_ids": ids} if any(ids) else {}


def _ends(v: Any, engine_ids: Any = None) -> list[RequestEnd]:
    ids = _list(engine_ids or [], "ended_engine_ids", MAX_REQUESTS)
    for e in ids:
        _str(e, "ended_engine_ids", MAX_REQUEST_ID_CHARS)
    entries = _list(v, "ended", MAX_REQUESTS)
    if ids and len(ids) != len(entries):
        raise WireError(
            "header field 'ended_engine_ids': must have one entry per 'ended' entry",
            "ended_engine_ids",
        )
    out = []
    for i, e in enumerate(entries):
        if type(e) is not list or len(e) != 3:
            raise WireError(
                f"header field 'ended': {capped(e)} is not [request_id, sample_index, reason]",
                "ended",
            )
        out.append(
            RequestEnd(
                _str(e[0], "ended", MAX_REQUEST_ID_CHARS, "request id"),
                _int(e[1], "ended", 0, MAX_INT32, "sample index"),
                _str(e[2], "ended", MAX_REASON_CHARS, "reason"),
                ids[i] if ids else "",
            )
        )
    return out


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


PROOF_BYTES = 8
"""A data message's receipt: a CREDIT that frees it echoes this, so a peer cannot
acknowledge (and be sent more on the strength of) messages it never read."""


def pack_seq(seq: int, proof: bytes) -> bytes:
    """Per-subscriber sequence number (a gap means messages were dropped) and the
    message's receipt."""
    return seq.to_bytes(8, "little") + proof


def unpack_seq(raw: bytes | memoryview) -> tuple[int, bytes]:
    if len(raw) != 8 + PROOF_BYTES:
        raise WireError(f"sequence frame must be {8 + PROOF_BYTES} bytes")
    raw = bytes(raw)
    return int.from_bytes(raw[:8], "little"), raw[8:]


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
        raise WireError(
            f"tensor frame has {len(buf)} bytes, header says {hdr.nbytes} (shape {hdr.shape}, "
            f"{hdr.dtype})",
            "shape",
        )
    if hdr.nbytes == 0:
        return torch.empty(hdr.shape, dtype=DTYPES[hdr.dtype])
    return torch.frombuffer(buf, dtype=DTYPES[hdr.dtype]).view(hdr.shape)


# zmq frames are read-only and consumers must not write into them; torch warns
# about that on every message. Silenced once here, for this module's calls only
# (a catch_warnings block per message cost more than the rest of the decode).
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)
