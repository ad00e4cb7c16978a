"""Returned activations over HTTP: their JSON form, their binary form, and the bounds.

A request over the OpenAI server asks with ``"return": true`` (rows inline in each
choice, base64 of the raw little-endian array) or ``"return": "fetch"`` (each choice
names a one-time ``GET /v1/actbus/returns/ID`` answered with safetensors). The format is
in docs/http.md; ``actbus.client`` reads it back.

What one HTTP caller can make the server hold is bounded here, before its request is
queued, in the bytes the server holds the rows in (base64 text inline, 4/3 of the raw
bytes; raw when kept for fetching): the rows one HTTP call could get back (over its
prompts, each its samples x the positions its prompt and ``max_tokens`` allow x its
taps x a row's bytes) against ``http_return_max_request_mb``; everything held for HTTP
callers at once (calls in flight, reserved at that upper bound, plus rows waiting to be
fetched) against ``http_return_max_server_mb``; and what one client keeps (or has on
its way) for fetching against ``http_return_fetch_client_mb``, so that one client's
unfetched rows cannot starve the others.

A reservation lasts until its call's response is sent (``actbus.capture.calls``): a
response nobody reads keeps its call's share held, so the rows of clients that never
read are bounded by the server's limit, not by how many connect. Rows kept for fetching
take their sample's place in the store. An aborted request lets go at once; whatever
happens, a reservation goes with the request's parameters and its call. Without a call
(a server without actbus's middleware) each prompt is bounded alone and let go at its
final output.
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
from typing import TYPE_CHECKING, Any

import torch

from actbus.capture.returns import Activations, _expected_rows
from actbus.capture.selection import Selection
from actbus.errors import ConfigError
from actbus.streams import point_key

if TYPE_CHECKING:  # the call's module lets go of its reservations here
    from actbus.capture.calls import HttpCall

WHERE = "extra_args.actbus.return"
FETCH = "fetch"
FETCH_PATH = "/v1/actbus/returns/"
MIB = 1 << 20
CHUNK_WAIT_S = 0.25
"""How long a streamed chunk waits for its tokens' rows at most, by default
(``http_return_chunk_wait_s``)."""
ENCODING = "base64-raw-le"
"""The inline encoding's name: base64 of the rows' raw bytes, little-endian, row-major."""


def b64_len(nbytes: int) -> int:
    """The length of ``nbytes`` bytes in base64: what inline rows take in a response."""
    return 4 * ((nbytes + 2) // 3)


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
    if acts.late:
        out["late"] = acts.late
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


@dataclass(eq=False)
class Ticket:
    """One admitted prompt's reservation; its garbage collection lets go what is left."""

    token: int
    per_sample: int
    fetch: bool
    until_sent: bool = False
    """Held until its HTTP call's response is sent (``end_call``), not its final output."""


@dataclass
class _Hold:
    nbytes: int
    client: str | None
    fetch: bool
    call: int  # id() of its HttpCall, 0 without one


@dataclass
class _Stored:
    blob: bytes
    expires: float
    client: str | None


class HttpReturns:
    """The server's bytes of rows for HTTP callers: reserved by requests in flight and
    held for fetching; one per process (``for_config``).

    With an HTTP call (``actbus.capture.calls``: actbus's middleware opened one) the
    prompts of one call are bounded together, their reservation lasts until the call's
    response is sent, and rows kept for fetching are shared out by client."""

    def __init__(
        self,
        max_request: int,
        max_server: int,
        ttl_s: float,
        max_client: int | None = None,
        chunk_wait_s: float = CHUNK_WAIT_S,
    ) -> None:
        self.max_request, self.max_server, self.ttl_s = max_request, max_server, ttl_s
        self.max_client = max_server if max_client is None else max_client
        self.chunk_wait_s = chunk_wait_s
        """How long a streamed chunk waits for its tokens' rows at most."""
        self.streamed = {"chunks": 0, "waits": 0, "wait_s": 0.0, "wait_max_s": 0.0,
                         "late_chunks": 0, "late_rows": 0}  # fmt: skip
        """Streamed chunks that carried rows; those that waited for them, the seconds
        waited in all and at most; those that went with rows missing (``late``), and
        the rows that came in a later chunk than their tokens."""
        self._lock = threading.Lock()
        self._holds: dict[int, _Hold] = {}  # ticket token -> bytes still reserved
        # vLLM's sample id -> (ticket token, bytes, held until its call is sent)
        self._samples: dict[str, tuple[int, int, bool]] = {}
        self._fetch_of: dict[str, bool] = {}  # vLLM's sample id -> rows kept for fetching
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        self._stored_bytes = 0
        self._client_stored: dict[str, int] = {}
        self._next = 0
        self.refused = {"request": 0, "server": 0, "client": 0, "store": 0}
        """Requests refused by each limit, and stored rows refused for want of room."""
        self.expired = [0, 0]
        """Rows kept for fetching and never fetched: choices and bytes dropped at their TTL."""

    # ------------------------------------------------------------- admission
    def held(self) -> int:
        """Bytes reserved and stored now."""
        with self._lock:
            self._expire(time.monotonic())
            return self._held()

    def _held(self) -> int:
        return sum(h.nbytes for h in self._holds.values()) + self._stored_bytes

    def _client_held(self, client: str) -> int:
        """Under the lock: a client's rows stored, and reserved for fetching."""
        flight = sum(h.nbytes for h in self._holds.values() if h.fetch and h.client == client)
        return self._client_stored.get(client, 0) + flight

    def admit(
        self,
        sel: Selection,
        prompt_len: int,
        max_tokens: int | None,
        n: int,
        row_bytes: int,
        fetch: bool,
        call: HttpCall | None = None,
    ) -> Ticket:
        """Reserve what a prompt may get back, or refuse it naming the limit; the prompts
        of one ``call`` count together."""
        limit = prompt_len + max(int(max_tokens or 1), 1) - 1  # positions it may feed
        rows = _expected_rows(sel, prompt_len, limit)
        rows = 1 if rows is None else rows  # "last": one row, with the end
        taps = len(sel.keys)
        per_sample = taps * (row_bytes * rows if fetch else b64_len(row_bytes * rows))
        total = per_sample * n
        how = f"{n} sample(s) x {rows} positions x {taps} taps x {row_bytes} bytes a row"
        how += "" if fetch else ", x 4/3 as base64 text"
        own = call.admitted if call is not None else 0
        if own + total > self.max_request:
            self.refused["request"] += 1
            raise ConfigError(self._too_big(call, own + total, total, how))
        client = call.client if call is not None else None
        with self._lock:
            self._expire(time.monotonic())
            held = self._held()
            mine = sum(h.nbytes for h in self._holds.values() if call and h.call == id(call))
            if held + total > self.max_server:
                self.refused["server"] += 1
                raise ConfigError(
                    f"{WHERE}: the server holds {(held - mine) / MIB:.2f} MiB of rows for "
                    f"other HTTP calls, and this call's {(own + total) / MIB:.2f} MiB would "
                    f"pass its http_return_max_server_mb ({self.max_server / MIB:.4g} MiB); "
                    "retry once those are done or fetched"
                )
            if fetch and client is not None:
                theirs = self._client_held(client)
                if theirs + total > self.max_client:
                    self.refused["client"] += 1
                    raise ConfigError(
                        f"{WHERE}: this client ({client}) has {theirs / MIB:.2f} MiB of rows "
                        f"kept or on their way for fetching, and this request's "
                        f"{total / MIB:.2f} MiB would pass the server's "
                        f"http_return_fetch_client_mb ({self.max_client / MIB:.4g} MiB); fetch "
                        f"them (GET {FETCH_PATH}ID) or wait for them to expire"
                    )
            self._next += 1
            token = self._next
            self._holds[token] = _Hold(total, client, fetch, id(call) if call else 0)
        ticket = Ticket(token, per_sample, fetch, until_sent=call is not None)
        weakref.finalize(ticket, self._free, token)
        if call is not None:
            call.hold(ticket, total)
        return ticket

    def _too_big(self, call: HttpCall | None, whole: int, total: int, how: str) -> str:
        cap = f"http_return_max_request_mb ({self.max_request / MIB:.4g} MiB)"
        fewer = "layers, hooks, positions or max_tokens, or subscribe to the bus"
        if call is None or not call.prompts:
            return (
                f"{WHERE}: this request may get up to {total / MIB:.2f} MiB of rows back "
                f"({how}), over the server's {cap}; ask for fewer {fewer}"
            )
        return (
            f"{WHERE}: this HTTP call's {call.prompts + 1} prompts may get up to "
            f"{whole / MIB:.2f} MiB of rows back in all (its prompt {call.prompts}: "
            f"{total / MIB:.2f} MiB, {how}), over the server's {cap}, which bounds one "
            f"call over all its prompts and samples; send fewer prompts, or ask for "
            f"fewer samples, {fewer}"
        )

    def attach(self, ticket: Ticket, sample_id: str) -> None:
        """A sample of an admitted request, under vLLM's own id of it."""
        with self._lock:
            self._samples[sample_id] = (ticket.token, ticket.per_sample, ticket.until_sent)
            self._fetch_of[sample_id] = ticket.fetch

    def wants_fetch(self, sample_id: str) -> bool:
        with self._lock:
            return self._fetch_of.get(sample_id, False)

    def done(self, sample_ids: list[str], aborted: bool = False) -> None:
        """These samples' final outputs were made, or (``aborted``) they were aborted.
        A sample of an HTTP call keeps its reservation until the call's response is
        sent (or, asked for fetching, until its rows are stored: ``put``)."""
        with self._lock:
            for sid in sample_ids:
                self._fetch_of.pop(sid, None)
                got = self._samples.get(sid)
                if got is not None and (aborted or not got[2]):
                    self._release(sid)

    def _release(self, sid: str) -> None:
        """Under the lock: let a sample's reservation go."""
        got = self._samples.pop(sid, None)
        if got is None:
            return
        token, nbytes, _ = got
        hold = self._holds.get(token)
        if hold is not None:
            hold.nbytes -= nbytes
            if hold.nbytes <= 0:
                del self._holds[token]

    def end_call(self, call: HttpCall) -> None:
        """An HTTP call's response was sent, or its client is gone: what its prompts
        still reserve is let go."""
        tokens = call.close()
        with self._lock:
            for token in tokens:
                self._holds.pop(token, None)
            for sid in [s for s, got in self._samples.items() if got[0] in tokens]:
                del self._samples[sid]

    def _free(self, token: int) -> None:
        with self._lock:
            self._holds.pop(token, None)
            for sid in [s for s, got in self._samples.items() if got[0] == token]:
                del self._samples[sid]
                self._fetch_of.pop(sid, None)

    # ------------------------------------------------------------- fetching
    def put(self, blob: bytes, sample_id: str | None = None) -> str | None:
        """Keep a choice's rows to be fetched once, in place of its sample's reservation;
        their id, or None when the server (or the client's share) has no room left."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            got = self._samples.get(sample_id) if sample_id is not None else None
            hold = self._holds.get(got[0]) if got is not None else None
            client = hold.client if hold is not None else None
            if got is not None:
                self._release(sample_id)
            room = self._held() + len(blob) <= self.max_server and (
                client is None or self._client_held(client) + len(blob) <= self.max_client
            )
            if not room:
                self.refused["store"] += 1
                return None
            key = secrets.token_urlsafe(24)
            self._stored[key] = _Stored(blob, now + self.ttl_s, client)
            self._stored_bytes += len(blob)
            if client is not None:
                self._client_stored[client] = self._client_stored.get(client, 0) + len(blob)
            return key

    def take(self, key: str) -> bytes | None:
        """The rows kept under ``key``, once; None when unknown, fetched or expired."""
        with self._lock:
            self._expire(time.monotonic())
            got = self._stored.pop(key, None)
            if got is None:
                return None
            self._unstore(got)
            return got.blob

    def chunk_sent(self, waited_s: float, late: int, carried_late: int) -> None:
        """A streamed chunk carried a choice's rows: it waited ``waited_s`` for them,
        went with ``late`` still missing, and carried ``carried_late`` of an earlier
        chunk's tokens."""
        with self._lock:
            s = self.streamed
            s["chunks"] += 1
            if waited_s > 0:
                s["waits"] += 1
                s["wait_s"] += waited_s
                s["wait_max_s"] = max(s["wait_max_s"], waited_s)
            s["late_chunks"] += late > 0
            s["late_rows"] += carried_late

    def stats(self) -> dict[str, Any]:
        """What is held, every request and choice refused or dropped, and what streamed
        chunks waited for their rows, for ``GET /v1/actbus/returns``."""
        with self._lock:
            self._expire(time.monotonic())
            streamed = dict(self.streamed, chunk_wait_s=self.chunk_wait_s)
            for k in ("wait_s", "wait_max_s"):
                streamed[k] = round(streamed[k], 6)
            return {
                "held_bytes": self._held(),
                "stored": len(self._stored),
                "stored_bytes": self._stored_bytes,
                "stored_by_client": dict(self._client_stored),
                "refused": dict(self.refused),
                "expired": self.expired[0],
                "expired_bytes": self.expired[1],
                "streamed": streamed,
                "limits_mb": {
                    "http_return_max_request_mb": self.max_request / MIB,
                    "http_return_max_server_mb": self.max_server / MIB,
                    "http_return_fetch_client_mb": self.max_client / MIB,
                },
            }

    def _unstore(self, got: _Stored) -> None:
        self._stored_bytes -= len(got.blob)
        if got.client is not None:
            left = self._client_stored.get(got.client, 0) - len(got.blob)
            if left > 0:
                self._client_stored[got.client] = left
            else:
                self._client_stored.pop(got.client, None)

    def _expire(self, now: float) -> None:
        """Under the lock: drop stored rows past their time (kept in expiry order),
        counted."""
        while self._stored:
            key, first = next(iter(self._stored.items()))
            if first.expires > now:
                break
            del self._stored[key]
            self._unstore(first)
            self.expired[0] += 1
            self.expired[1] += len(first.blob)


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
                int(cfg.http_return_fetch_client_mb * MIB),
                float(cfg.http_return_chunk_wait_s),
            )
        return _ONE


def stats() -> dict[str, Any]:
    """``HttpReturns.stats`` of this process; all zeros (limits too) until a request
    asked rows back over HTTP."""
    return (_ONE or HttpReturns(0, 0, 0.0)).stats()


def current() -> HttpReturns | None:
    """The process's bounds, once a request asked over HTTP (the fetch endpoint's)."""
    return _ONE


def row_bytes(hidden: int, dtype: torch.dtype) -> int:
    return int(hidden) * torch.empty(0, dtype=dtype).element_size()
