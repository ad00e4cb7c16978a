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
(a socket file the killed publisher left behind).
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
_MAX_FRAME = 256 << 10


def announce_end(
    address: str,
    *,
    linger_s: float = LINGER_S,
    reason: str = "the server stopped",
    server_secret_key: str | None = None,
    authorized_keys: str | None = None,
    insecure_allow_any_interface: bool = False,
) -> int:
    """Answer every subscriber heard at ``address`` within ``linger_s`` with END (with
    the publisher's CURVE keys, if it had them); returns how many were told, or 0 when
    the address is still in use (a live publisher ends its stream itself)."""
    if _listening(address):
        log.info("%s is still served; its publisher ends the stream itself", address)
        return 0
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
            sock.bind(address)
        except zmq.ZMQError as e:
            log.info("cannot bind %s to send END (%s); leaving it", address, e)
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
    return len(told)


def announce_end_all(addresses: list[str], **kw: Any) -> int:
    """``announce_end`` at several addresses at once (the data-parallel ranks of one
    node), so their ``linger_s`` is spent once; how many subscribers were told in all."""
    if len(addresses) <= 1:
        return sum(announce_end(a, **kw) for a in addresses)
    with ThreadPoolExecutor(len(addresses), thread_name_prefix="actbus-farewell") as pool:
        return sum(pool.map(lambda a: announce_end(a, **kw), addresses))


def _listening(address: str) -> bool:
    """Whether a process accepts connections on an ``ipc://`` path (tcp: the bind says)."""
    if not address.startswith("ipc://"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(address.removeprefix("ipc://"))
        except OSError:
            return False
    return True
