"""The engine's control endpoint: authenticated pushes of monitor weights and live
steering vectors while serving.

The engine core binds a ROUTER socket at ``actbus.control`` (one per data-parallel
engine core, like the publisher). Its rules are the publisher's (``security``) and
stricter: an ipc path by default; TCP only with CURVE keys, and then only clients
whose public key is in ``authorized_keys`` get through the handshake. Control writes
into the model's monitors, so an ipc socket file is readable and writable by the
engine's user only from the moment it exists (``bind_private_ipc``), and TCP control
needs CURVE keys even on loopback: any local user can reach a loopback port, and
ZeroMQ cannot tell who they are (``insecure_allow_any_interface`` opts out).

A peer sends ``encode_push`` / ``encode_vector_push`` frames (or ``{"op": "status"}``,
or ``{"op": "swaps", "start": N}`` for a page of the swap log: ``ControlClient.swaps``)
and gets one msgpack reply: ``{"ok": true, "monitor" (or "vector"), "version",
"received"}`` or ``{"ok": false, "field", "error"}``. Every message is checked here, on
this thread (size, shape, finite values, known monitor or live vector, increasing
version: ``actbus.bus.pushwire``); a refused one changes nothing. Memory is bounded
whatever peers send: at most one pending push per monitor and per live vector (a newer
one replaces a pending one that no step used yet), a message size cap
(``ZMQ_MAXMSGSIZE``: a larger one drops that peer's connection), a receive queue
bound, and replies bounded in size (``status`` holds the last ``SWAPS_REPORTED`` swaps
and figures over the last ``SWAPS_KEPT``) and in number per peer (``ZMQ_SNDHWM``: a
peer that never reads its replies loses the newer ones, counted in
``replies_dropped``). Refused pushes are logged at a bounded rate (``LogRate``).

``take`` hands the pending pushes to the scheduler for the next step and records,
per version, when it was received and when the step that uses it was scheduled
(``status``: the ``swap_ms`` figures).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from actbus.bus.addresses import check_address
from actbus.bus.pushwire import (
    Push,
    PushError,
    Slot,
    check_push,
    check_vector_push,
    encode_push,
    encode_vector_push,
)
from actbus.bus.security import ClientAuth, ServerAuth, bind_private_ipc, check_server_keys
from actbus.errors import ConfigError
from actbus.logcap import LogRate, capped_text

log = logging.getLogger("actbus.control")

MAX_HEADER_BYTES = 4096
MAX_FRAMES = 4
RECV_HWM = 64
SEND_HWM = 4
"""Replies queued per peer, at most: one that does not read them loses the newer ones."""
SWAPS_KEPT = 4096
"""Swaps the ``swap_ms`` figures of ``status`` are taken over."""
SWAPS_REPORTED = 32
"""Swap records a ``status`` reply holds (the latest): a reply stays a few KiB."""
FIELD = "actbus.control"


@dataclass(frozen=True)
class ControlConfig:
    """``actbus.control``: an address, or ``{"address", "server_secret_key",
    "authorized_keys", "insecure_allow_any_interface"}`` (keys default to the engine's
    own ``actbus.server_secret_key`` / ``actbus.authorized_keys``)."""

    address: str
    server_secret_key: str | None = None
    authorized_keys: str | None = None
    insecure_allow_any_interface: bool = False

    @classmethod
    def from_raw(cls, raw: Any, defaults: dict[str, Any]) -> ControlConfig:
        if isinstance(raw, str):
            raw = {"address": raw}
        if not isinstance(raw, dict) or "address" not in raw:
            raise ConfigError(
                f"{FIELD}: expected an address such as 'ipc:///tmp/actbus-control.sock' or "
                "{'address': ..., 'server_secret_key': ..., 'authorized_keys': ...}"
            )
        valid = ("address", "server_secret_key", "authorized_keys", "insecure_allow_any_interface")
        for k in raw:
            if k not in valid:
                raise ConfigError(f"{FIELD}.{k}: unknown key; valid keys are {', '.join(valid)}")
        keys = {
            k: raw.get(k, defaults.get(k))
            for k in ("server_secret_key", "authorized_keys")
            if raw.get(k, defaults.get(k)) is not None
        }
        if keys:
            check_server_keys(**keys, prefix=f"{FIELD}.")
            keys = {k: os.path.abspath(v) for k, v in keys.items()}
        insecure = raw.get("insecure_allow_any_interface", False)
        if not isinstance(insecure, bool):
            raise ConfigError(f"{FIELD}.insecure_allow_any_interface: expected true or false")
        check_address(
            raw["address"],
            field_name=f"{FIELD}.address",
            curve=bool(keys),
            insecure_allow_any_interface=insecure,
        )
        check_keyless_tcp(raw["address"], curve=bool(keys), insecure=insecure)
        return cls(raw["address"], insecure_allow_any_interface=insecure, **keys)


def check_keyless_tcp(address: str, *, curve: bool, insecure: bool) -> None:
    """Refuse control on TCP without CURVE keys, loopback included: every local user can
    connect to a loopback port and push weights, and ZeroMQ cannot tell who connected.
    An ipc socket file (0600) lets only this user in."""
    if curve or insecure or not address.startswith("tcp://"):
        return
    raise ConfigError(
        f"{FIELD}.address={address!r}: control on TCP needs CURVE keys, even on loopback "
        "(any local user can reach a loopback port and push weights); bind an ipc path "
        "(ipc:///run/user/UID/actbus-control.sock: only this user may connect), or run "
        f"`actbus keys DIR` and set {FIELD}.server_secret_key=DIR/server.key_secret and "
        f"{FIELD}.authorized_keys=DIR/authorized_keys"
    )


class ControlServer:
    """The endpoint's socket thread and the pushes waiting for a step. Thread-safe."""

    def __init__(
        self,
        cfg: ControlConfig,
        slots: dict[str, Slot],
        versions: dict[str, int],
        vectors: dict[str, int] | None = None,
    ) -> None:
        """``slots``: the monitors' tables (``versions``: each monitor's version now);
        ``vectors``: the live steering vectors' widths (each starts at version 1)."""
        self.cfg = cfg
        self.slots = slots
        self.vectors = dict(vectors or {})
        self.versions = dict(versions)  # latest accepted, pending included
        self.in_use = dict(versions)  # latest handed to a step
        self.vector_versions = {n: 1 for n in self.vectors}
        self.vector_in_use = dict(self.vector_versions)
        self.accepted = 0
        self.refused = 0
        self.superseded = 0
        self.replies_dropped = 0
        self._refused_log = LogRate(per_s=1.0, burst=10)  # the socket thread's only
        self._swaps_total = 0
        self._pending: dict[tuple[str, str], Push] = {}
        self._swaps: deque[dict[str, Any]] = deque(maxlen=SWAPS_KEPT)
        self._lock = threading.Lock()
        self._auth = ServerAuth(
            cfg.address,
            server_secret_key=cfg.server_secret_key,
            authorized_keys=cfg.authorized_keys,
            insecure_allow_any_interface=cfg.insecure_allow_any_interface,
            prefix=f"{FIELD}.",
        )
        check_keyless_tcp(
            cfg.address, curve=self._auth.curve, insecure=cfg.insecure_allow_any_interface
        )
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.rcvhwm = RECV_HWM
        self._sock.sndhwm = SEND_HWM
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises: counted
        largest = max([s.nbytes for s in slots.values()] + [4 * w for w in self.vectors.values()])
        self._sock.setsockopt(zmq.MAXMSGSIZE, largest + 65536)
        self._auth.apply(self._ctx, self._sock)
        self._ipc_path: Path | None = None
        if cfg.address.startswith("ipc://") and not cfg.address.startswith("ipc://@"):
            self._ipc_path = bind_private_ipc(self._sock, cfg.address)
        else:
            self._sock.bind(cfg.address)
        self._call_id: int | None = None
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="actbus-control", daemon=True)
        self._thread.start()
        log.info(
            "actbus: control endpoint on %s (monitors %s, live vectors %s)",
            cfg.address, sorted(slots), sorted(self.vectors),
        )  # fmt: skip

    # ----------------------------------------------------------- scheduler side
    def take(self) -> list[Push]:
        """The pending pushes, for the step being scheduled now."""
        if not self._pending:  # unlocked peek: a push arriving now waits one step
            return []
        now = time.time()
        with self._lock:
            out = list(self._pending.values())
            self._pending.clear()
            for p in out:
                (self.in_use if p.kind == "monitor" else self.vector_in_use)[p.name] = p.version
                self._swaps_total += 1
                self._swaps.append(
                    {
                        p.kind: p.name,
                        "version": p.version,
                        "received": p.received,
                        "scheduled": now,
                        "swap_ms": (now - p.received) * 1e3,
                    }
                )
        return out

    def status(self) -> dict[str, Any]:
        """Versions, counters, the latest ``SWAPS_REPORTED`` swaps, and the ``swap_ms``
        figures (p50, p99, max) over the last ``SWAPS_KEPT``: a few KiB however long
        the engine has run."""
        with self._lock:
            ms = np.fromiter((s["swap_ms"] for s in self._swaps), float, len(self._swaps))
            recent = list(itertools.islice(self._swaps, max(0, len(ms) - SWAPS_REPORTED), None))
            return {
                "ok": True,
                "monitors": {
                    n: {"version": self.versions[n], "in_use": self.in_use[n]} for n in self.slots
                },
                "vectors": {
                    n: {"version": self.vector_versions[n], "in_use": self.vector_in_use[n]}
                    for n in self.vectors
                },
                "accepted": self.accepted,
                "refused": self.refused,
                "superseded": self.superseded,
                "replies_dropped": self.replies_dropped,
                "swaps": recent,
                "swaps_total": self._swaps_total,
                "swap_ms": {
                    "over": len(ms),
                    "p50": float(np.percentile(ms, 50)) if len(ms) else None,
                    "p99": float(np.percentile(ms, 99)) if len(ms) else None,
                    "max": float(ms.max()) if len(ms) else None,
                },
            }

    def swaps_page(self, start: Any) -> dict[str, Any]:
        """At most ``SWAPS_REPORTED`` swap records from number ``start`` (swaps are
        numbered from 0 since the engine started; the last ``SWAPS_KEPT`` are kept):
        ``{"ok", "swaps", "next"}``, ``next`` the number after the last one given."""
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise PushError("start", "expected a swap number, an integer >= 0")
        with self._lock:
            first = self._swaps_total - len(self._swaps)
            at = max(start, first)
            end = min(at + SWAPS_REPORTED, self._swaps_total)
            page = list(itertools.islice(self._swaps, at - first, end - first))
            return {"ok": True, "swaps": page, "next": max(end, at)}

    # -------------------------------------------------------------- socket side
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                msg = self._sock.recv_multipart(copy=True)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("actbus: control socket error")
                continue
            ident, frames = msg[0], msg[1:]
            self._call_id = None
            try:
                reply = self._handle(frames)
            except PushError as e:
                with self._lock:
                    self.refused += 1
                reply = {"ok": False, "field": e.field, "error": str(e)}
                self._refused_log.log(
                    log, logging.WARNING, "actbus: refused a push (%d so far): %s",
                    self.refused, capped_text(str(e)),
                )  # fmt: skip
            except Exception as e:  # never let one peer's message end the endpoint
                self._refused_log.log(
                    log, logging.ERROR, "actbus: a message to the control endpoint failed: %s",
                    capped_text(f"{type(e).__name__}: {e}"),
                )  # fmt: skip
                reply = {"ok": False, "field": "message", "error": f"{type(e).__name__}: {e}"}
            if self._call_id is not None:
                reply["id"] = self._call_id
            try:
                self._sock.send_multipart([ident, msgpack.packb(reply)], zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer left, or does not read its replies
                with self._lock:
                    self.replies_dropped += 1

    def _handle(self, frames: list[bytes]) -> dict[str, Any]:
        if not frames or len(frames) > MAX_FRAMES or len(frames[0]) > MAX_HEADER_BYTES:
            raise PushError(
                "message", f"expected a header and at most {MAX_FRAMES - 1} array frames"
            )
        try:
            header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
        except Exception:
            raise PushError("message", "the header is not msgpack") from None
        if not isinstance(header, dict):
            raise PushError("message", "the header is not a map")
        if isinstance(header.get("id"), int):
            self._call_id = header["id"]  # echoed, so a client matches replies to calls
        op = header.get("op")
        if op == "status":
            return self.status()
        if op == "swaps":
            return self.swaps_page(header.get("start", 0))
        if op != "push":
            raise PushError("op", f"{str(op)[:20]!r} is not one of push, status, swaps")
        if "monitor" in header and "vector" in header:
            raise PushError("message", "a push names a monitor or a vector, not both")
        with self._lock:
            if "vector" in header:
                push = check_vector_push(header, frames[1:], self.vectors, self.vector_versions)
                self.vector_versions[push.name] = push.version
            else:
                push = check_push(header, frames[1:], self.slots, self.versions)
                self.versions[push.name] = push.version
            if push.key in self._pending:
                self.superseded += 1
            self._pending[push.key] = push
            self.accepted += 1
        return {
            "ok": True,
            push.kind: push.name,
            "version": push.version,
            "received": push.received,
        }

    def close(self) -> None:
        """Stop serving and let go of the address. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._auth.close()
        self._ctx.term()
        if self._ipc_path is not None:  # ZeroMQ unlinked only the name it bound
            with contextlib.suppress(OSError):
                self._ipc_path.unlink()


class PushRefused(RuntimeError):
    """The engine refused a push; ``field`` names what was wrong."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(str(reply.get("error")))
        self.field = reply.get("field")


class ControlClient:
    """A trainer's (or a script's) side: push monitor weights or live steering vectors,
    ask for the status.

    ``server_key`` / ``client_secret_key``: CURVE, as for a subscriber (``actbus keys``).
    Each call waits for the engine's reply up to ``timeout_s``; a refused CURVE
    handshake is reported as such, not as a silent timeout."""

    def __init__(
        self,
        address: str,
        *,
        server_key: str | None = None,
        client_secret_key: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.address = check_address(address, field_name="--push", allow_remote=True)
        self.timeout_s = timeout_s
        self._auth = ClientAuth(
            address,
            server_key=server_key,
            client_secret_key=client_secret_key,
            fields=("--push-server-key", "--push-client-secret-key"),
        )
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._auth.apply(self._sock)
        self._sock.connect(address)
        self._calls = 0

    def push(
        self,
        monitor: str,
        weight: Any,
        bias: Any,
        threshold: Any = None,
        version: int | None = None,
    ) -> dict[str, Any]:
        """Send new weights for ``monitor``; the engine's reply (its ``version``).
        Raises ``PushRefused`` naming the field, or ``TimeoutError``."""
        self._calls += 1
        frames = encode_push(monitor, weight, bias, threshold, version, call_id=self._calls)
        return self._call(frames)

    def push_vector(self, vector: str, values: Any, version: int | None = None) -> dict[str, Any]:
        """Send new values (``hidden`` floats) for the engine's live steering vector
        ``vector``; the engine's reply (its ``version``). Raises ``PushRefused`` naming
        the field, or ``TimeoutError``."""
        self._calls += 1
        return self._call(encode_vector_push(vector, values, version, call_id=self._calls))

    def status(self) -> dict[str, Any]:
        """Versions and counters; the latest swaps (``swaps``) and their figures
        (``swap_ms``: p50, p99, max over the last ``SWAPS_KEPT``)."""
        self._calls += 1
        return self._call([msgpack.packb({"op": "status", "id": self._calls})])

    def swaps(self, start: int = 0) -> list[dict[str, Any]]:
        """Every swap record the engine keeps from number ``start`` on (the last
        ``SWAPS_KEPT``), read a page at a time so each reply stays small."""
        out: list[dict[str, Any]] = []
        while True:
            self._calls += 1
            reply = self._call([msgpack.packb({"op": "swaps", "start": start, "id": self._calls})])
            out += reply["swaps"]
            if not reply["swaps"]:
                return out
            start = reply["next"]

    def _call(self, frames: list[bytes]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:  # a DEALER with no connection (a refused handshake) cannot send
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:
                why = self._auth.failure()
                if why:
                    raise PermissionError(why.replace("publisher", "control endpoint")) from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"could not reach the control endpoint at {self.address} in "
                        f"{self.timeout_s}s"
                    ) from None
                time.sleep(0.02)
        while time.monotonic() < deadline:
            if self._sock.poll(50):
                reply = msgpack.unpackb(self._sock.recv(), raw=False)
                if reply.get("id", self._calls) != self._calls:
                    continue  # the late answer to a call that timed out
                if not reply.get("ok"):
                    raise PushRefused(reply)
                return reply
            why = self._auth.failure()
            if why:
                raise PermissionError(why.replace("publisher", "control endpoint"))
        raise TimeoutError(
            f"no reply from the control endpoint at {self.address} in {self.timeout_s}s"
        )

    def close(self) -> None:
        self._auth.close()
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
