"""END for the subscribers of a publisher that died without sending it.

Stopped by Ctrl-C or SIGTERM, vLLM's server kills its engine processes at once (its
shutdown timeout is 0 by default), so the capture worker's publisher never closes and
never sends END: consumers waiting for it (``--exit-on-end``, trainers) would wait
forever, subscribing again and again. ``actbus serve`` runs the server as a child
and, once it has exited, calls ``announce_end``: it binds the dead publisher's address
for a moment and answers every subscriber that speaks there with END, once each.
Subscribers speak often enough to hear it in time: CREDIT every half second while
subscribed, HELLO every second while not, and a busy one's KEEPALIVE names it.

It never takes an address someone still listens on: a bound ``tcp://`` port fails
the bind, and an ``ipc://`` path is bound only after a connection to it is refused
(a socket file the killed publisher left behind). A publisher's process that is still
dying holds its address for a moment after the server exited (vLLM's API server can
exit before the engine process it killed is gone, and a killed process with a large
heap takes a while to close its files): the address is tried again every
``POLL_S`` for up to ``release_s`` before it is left to whoever holds it, so END does
not depend on the order vLLM's processes stop in.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from actbus.bus.security import ServerAuth
from actbus.wire import BYE, END, KEEPALIVE, pack_map, unpack_map

log = logging.getLogger("actbus.farewell")
LINGER_S = 3.0
"""How long END is offered: a subscriber reconnects within 0.1 s and speaks within 1 s."""
RELEASE_S = 10.0
"""How long a dying publisher's process may hold its address before it is left to it
(vLLM gives an engine process 5 s to stop before it kills it)."""
POLL_S = 0.05
_MAX_FRAME = 256 << 10


def announce_end(
    address: str,
    *,
    linger_s: float = LINGER_S,
    release_s: float = RELEASE_S,
    reason: str = "the server stopped",
    server_secret_key: str | None = None,
    authorized_keys: str | None = None,
    insecure_allow_any_interface: bool = False,
) -> int:
    """Answer every subscriber heard at ``address`` within ``linger_s`` with END (with
    the publisher's CURVE keys, if it had them), once the address is free (waiting up
    to ``release_s`` for a dying process to let go of it); how many were told, or 0
    when it is still in use then (a live publisher ends its stream itself)."""
    auth = ServerAuth(
        address,
        server_secret_key=server_secret_key,
        authorized_keys=authorized_keys,
        insecure_allow_any_interface=insecure_allow_any_interface,
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
    told: set[bytes] = set()
    try:
        try:
            auth.apply(ctx, sock)
        except zmq.ZMQError as e:
            log.warning("cannot listen at %s to send END (%s); leaving it", address, e)
            return 0
        if not _bind_when_released(sock, address, release_s):
            return 0
        body = pack_map({"last_step": -1, "reason": reason})
        deadline = time.monotonic() + linger_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(min(left, 0.1) * 1000)):
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) != 3 or frames[1] == BYE:
                continue
            target = frames[0]
            if frames[1] == KEEPALIVE:  # a busy subscriber's second socket: tell the first
                try:
                    target = unpack_map(frames[2]).get("of")
                except Exception:
                    continue
                if not isinstance(target, bytes):
                    continue
            if target in told:
                continue
            with contextlib.suppress(zmq.ZMQError):  # not connected (yet): next time
                sock.send_multipart([target, END, body], zmq.NOBLOCK)
                told.add(target)
    finally:
        sock.close(linger=1000)  # END reaches those told; the ipc file goes with it
        auth.close()
        ctx.term()
    log.info("told %d subscriber(s) at %s the stream ended (%s)", len(told), address, reason)
    return len(told)


def _bind_when_released(sock: zmq.Socket, address: str, release_s: float) -> bool:
    """Bind ``sock`` to ``address`` once nobody listens there, trying again every
    ``POLL_S`` for up to ``release_s``; False (logged) if it stays taken."""
    t0 = time.monotonic()
    deadline = t0 + release_s
    waited = False
    while True:
        err = "a process still accepts connections there"
        if not held(address):
            try:
                sock.bind(address)
            except zmq.ZMQError as e:  # tcp: the port is still bound
                if e.errno != zmq.EADDRINUSE:
                    log.warning("cannot bind %s to send END (%s); leaving it", address, e)
                    return False
                err = str(e)
            else:
                if waited:
                    log.info("%s was released %.1fs later", address, time.monotonic() - t0)
                return True
        if time.monotonic() >= deadline:
            log.warning(
                "%s is still in use %.0fs later (%s): its publisher is alive and ends the "
                "stream itself, or another process holds it; END not sent from here",
                address,
                release_s,
                err,
            )
            return False
        if not waited:
            waited = True
            log.info(
                "%s is still held (%s); waiting up to %.0fs for its process to let go",
                address,
                err,
                release_s,
            )
        time.sleep(POLL_S)


def announce_end_all(addresses: list[str], **kw: Any) -> int:
    """``announce_end`` at several addresses at once (the data-parallel ranks of one
    node), so their ``linger_s`` is spent once; how many subscribers were told in all."""
    if len(addresses) <= 1:
        return sum(announce_end(a, **kw) for a in addresses)
    with ThreadPoolExecutor(len(addresses), thread_name_prefix="actbus-farewell") as pool:
        return sum(pool.map(lambda a: announce_end(a, **kw), addresses))


def held(address: str) -> bool:
    """Whether a process accepts connections at ``address``: an ``ipc://`` path or a
    ``tcp://`` port (on loopback for a wildcard host); False when it cannot be told."""
    if address.startswith("ipc://"):
        path = address.removeprefix("ipc://")
        family, target = socket.AF_UNIX, ("\0" + path[1:] if path.startswith("@") else path)
    elif address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "::1"}.get(host, host)
        try:
            family, _, _, _, target = socket.getaddrinfo(
                host.strip("[]"), int(port), type=socket.SOCK_STREAM
            )[0]
        except (OSError, ValueError):
            return False
    else:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(target)
        except OSError:
            return False
    return True


def wait_released(addresses: list[str], within_s: float) -> list[str]:
    """Wait up to ``within_s`` until no process accepts connections at any of
    ``addresses``; those still held then."""
    deadline = time.monotonic() + within_s
    while True:
        left = [a for a in addresses if held(a)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)
