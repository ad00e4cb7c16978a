"""Returned activations over HTTP: their JSON form, their binary form, and the bounds.

A request over the OpenAI server asks with ``"return": true`` (rows inline in each
choice, base64 of the raw little-endian array) or ``"return": "fetch"`` (each choice
names a one-time ``GET /v1/actbus/returns/ID`` answered with safetensors). The format is
in docs/http.md; ``actbus.client`` reads it back.

What one HTTP caller can make the server hold is bounded here, before its request is
queued: the rows it could get back (its samples x the positions its prompt and
``max_tokens`` allow x its taps x a row's bytes) against ``http_return_max_request_mb``,
and everything held for HTTP callers at once (requests in flight, reserved at that
upper bound, plus rows waiting to be fetched) against ``http_return_max_server_mb``. A
reservation is let go as each sample's final output is made or the request is aborted,
and, whatever happens, when the request's parameters are garbage collected.
"""

from __future__ import annotations

import base64
import secrets
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from actbus.capture.returns import Activations, _expected_rows
from actbus.capture.selection import Selection
from actbus.errors import ConfigError
from actbus.streams import point_key

WHERE = "extra_args.actbus.return"
FETCH = "fetch"
FETCH_PATH = "/v1/actbus/returns/"
MIB = 1 << 20
ENCODING = "base64-raw-le"
"""The inline encoding's name: base64 of the rows' raw bytes, little-endian, row-major."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``: what ``choices[i].actbus.activations`` says."""
    return str(dtype).removeprefix("torch.")


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, row-major and little-endian."""
    t = t.detach().contiguous()
    if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover (x86, ARM)
        return t.view(torch.uint8).numpy().reshape(-1, t.element_size())[:, ::-1].tobytes()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def to_json(acts: Activations, final: bool) -> dict[str, Any]:
    """The inline HTTP form of one choice's rows (``choices[i].actbus.activations``)."""
    rows = []
    for (layer, hook), t in acts.tensors.items():
        rows.append(
            {
                "layer": layer,
                "hook": hook,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data": base64.b64encode(_raw(t)).decode("ascii"),
            }
        )
    out: dict[str, Any] = {
        "encoding": ENCODING,
        "positions": acts.positions.tolist(),
        "token_ids": acts.token_ids.tolist(),
        "rows": rows,
    }
    if final:
        out["complete"] = acts.complete
    return out


def to_safetensors(acts: Activations) -> bytes:
    """The binary form: one tensor per stream (``L3.post_block``), ``positions`` and
    ``token_ids``; ``complete`` in the metadata."""
    from safetensors.torch import save

    tensors = {point_key(*k): t.contiguous() for k, t in acts.tensors.items()}
    tensors["positions"] = acts.positions.contiguous()
    tensors["token_ids"] = acts.token_ids.contiguous()
    return save(tensors, metadata={"complete": "true" if acts.complete else "false"})


def parse_return(value: Any) -> tuple[bool, str | None]:
    """``"return"`` as an HTTP caller may send it: (returns, HTTP mode)."""
    if value is True:
        return True, "inline"
    if value == FETCH:
        return True, FETCH
    if value is False:
        return False, None
    raise ConfigError(
        f"{WHERE}: expected true (rows in each choice), 'fetch' (rows kept for "
        f"GET {FETCH_PATH}ID) or false, got {value!r:.50}"
    )


@dataclass
class Ticket:
    """One admitted request's reservation; its garbage collection lets go what is left."""

    token: int
    per_sample: int
    fetch: bool


@dataclass
class _Stored:
    blob: bytes
    expires: float


class HttpReturns:
    """The server's bytes of rows for HTTP callers: reserved by requests in flight and
    held for fetching; one per process (``for_config``)."""

    def __init__(self, max_request: int, max_server: int, ttl_s: float) -> None:
        self.max_request, self.max_server, self.ttl_s = max_request, max_server, ttl_s
        self._lock = threading.Lock()
        self._reserved: dict[int, int] = {}  # ticket token -> bytes still reserved
        self._samples: dict[str, tuple[int, int]] = {}  # vLLM's sample id -> (token, bytes)
        self._fetch_of: dict[str, bool] = {}  # vLLM's sample id -> rows kept for fetching
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        self._stored_bytes = 0
        self._next = 0
        self.refused = {"request": 0, "server": 0, "store": 0}
        """Requests refused by each limit, and stored rows refused for want of room."""

    # ------------------------------------------------------------- admission
    def held(self) -> int:
        """Bytes reserved and stored now."""
        with self._lock:
            self._expire(time.monotonic())
            return sum(self._reserved.values()) + self._stored_bytes

    def admit(
        self,
        sel: Selection,
        prompt_len: int,
        max_tokens: int | None,
        n: int,
        row_bytes: int,
        fetch: bool,
    ) -> Ticket:
        """Reserve what a request may get back, or refuse it naming the limit."""
        limit = prompt_len + max(int(max_tokens or 1), 1) - 1  # positions it may feed
        rows = _expected_rows(sel, prompt_len, limit)
        rows = 1 if rows is None else rows  # "last": one row, with the end
        taps = len(sel.keys)
        per_sample = rows * taps * row_bytes
        total = per_sample * n
        how = f"{n} sample(s) x {rows} positions x {taps} taps x {row_bytes} bytes a row"
        if total > self.max_request:
            self.refused["request"] += 1
            raise ConfigError(
                f"{WHERE}: this request may get up to {total / MIB:.2f} MiB of rows back "
                f"({how}), over the server's http_return_max_request_mb "
                f"({self.max_request / MIB:g} MiB); ask for fewer layers, hooks, positions "
                "or max_tokens, or subscribe to the bus"
            )
        with self._lock:
            self._expire(time.monotonic())
            held = sum(self._reserved.values()) + self._stored_bytes
            if held + total > self.max_server:
                self.refused["server"] += 1
                raise ConfigError(
                    f"{WHERE}: the server holds {held / MIB:.2f} MiB of rows for other HTTP "
                    f"responses, and this request's {total / MIB:.2f} MiB would pass its "
                    f"http_return_max_server_mb ({self.max_server / MIB:g} MiB); retry once "
                    "those are done or fetched"
                )
            self._next += 1
            token = self._next
            self._reserved[token] = total
        ticket = Ticket(token, per_sample, fetch)
        weakref.finalize(ticket, self._free, token)
        return ticket

    def attach(self, ticket: Ticket, sample_id: str) -> None:
        """A sample of an admitted request, under vLLM's own id of it."""
        with self._lock:
            self._samples[sample_id] = (ticket.token, ticket.per_sample)
            self._fetch_of[sample_id] = ticket.fetch

    def wants_fetch(self, sample_id: str) -> bool:
        with self._lock:
            return self._fetch_of.get(sample_id, False)

    def done(self, sample_ids: list[str]) -> None:
        """These samples' final outputs were made, or they were aborted."""
        with self._lock:
            for sid in sample_ids:
                self._fetch_of.pop(sid, None)
                got = self._samples.pop(sid, None)
                if got is None:
                    continue
                token, nbytes = got
                left = self._reserved.get(token)
                if left is not None:
                    if left - nbytes > 0:
                        self._reserved[token] = left - nbytes
                    else:
                        del self._reserved[token]

    def _free(self, token: int) -> None:
        with self._lock:
            self._reserved.pop(token, None)
            for sid in [s for s, (t, _) in self._samples.items() if t == token]:
                del self._samples[sid]
                self._fetch_of.pop(sid, None)

    # ------------------------------------------------------------- fetching
    def put(self, blob: bytes) -> str | None:
        """Keep a choice's rows to be fetched once; its id, or None when the server has
        no room left under ``http_return_max_server_mb``."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            if sum(self._reserved.values()) + self._stored_bytes + len(blob) > self.max_server:
                self.refused["store"] += 1
                return None
            key = secrets.token_urlsafe(24)
            self._stored[key] = _Stored(blob, now + self.ttl_s)
            self._stored_bytes += len(blob)
            return key

    def take(self, key: str) -> bytes | None:
        """The rows kept under ``key``, once; None when unknown, fetched or expired."""
        with self._lock:
            self._expire(time.monotonic())
            got = self._stored.pop(key, None)
            if got is None:
                return None
            self._stored_bytes -= len(got.blob)
            return got.blob

    def _expire(self, now: float) -> None:
        """Under the lock: drop stored rows past their time (kept in expiry order)."""
        while self._stored:
            key, first = next(iter(self._stored.items()))
            if first.expires > now:
                break
            del self._stored[key]
            self._stored_bytes -= len(first.blob)


_ONE: HttpReturns | None = None
_MAKING = threading.Lock()


def for_config(cfg: Any) -> HttpReturns:
    """This process's bounds, from the engine's capture config (made once)."""
    global _ONE
    with _MAKING:
        if _ONE is None:
            _ONE = HttpReturns(
                int(cfg.http_return_max_request_mb * MIB),
                int(cfg.http_return_max_server_mb * MIB),
                float(cfg.http_return_fetch_ttl_s),
            )
        return _ONE


def current() -> HttpReturns | None:
    """The process's bounds, once a request asked over HTTP (the fetch endpoint's)."""
    return _ONE


def row_bytes(hidden: int, dtype: torch.dtype) -> int:
    return int(hidden) * torch.empty(0, dtype=dtype).element_size()
