"""ZeroMQ addresses: which are well formed, and which reach this machine only.

Beside the security code because the two decide together who may bind where: a
non-loopback bind needs CURVE keys (``security.ServerAuth``) or an explicit opt-out.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Any

from actbus.errors import ConfigError

_TCP = re.compile(r"tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+|\*)")
"""Matched whole (``fullmatch``): ``$`` would let a trailing newline through."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_address(
    addr: Any,
    *,
    field_name: str,
    allow_remote: bool = False,
    curve: bool = False,
    insecure_allow_any_interface: bool = False,
) -> str:
    """Validate a ZeroMQ address.

    A bind address (``allow_remote=False``) on anything but an ipc path or loopback
    is refused unless CURVE keys secure it (``curve``) or the user said
    ``insecure_allow_any_interface``: activations are model internals, and a
    ``block`` subscriber can stall generation, so nobody should get either by accident.
    That includes Linux abstract ipc names (``ipc://@name``): they have no file, so
    no permissions, and every local user can connect.
    """
    if not isinstance(addr, str):
        raise ConfigError(f"{field_name}: expected a string address, got {addr!r}")
    if _CONTROL.search(addr):
        raise ConfigError(
            f"{field_name}={addr!r}: control characters (a newline?) in the address; remove them"
        )
    if addr.startswith("ipc://"):
        path = addr[len("ipc://") :]
        if not path or path.startswith("@"):
            if path.startswith("@") and len(path) > 1:
                if allow_remote or curve or insecure_allow_any_interface:
                    return addr  # Linux abstract namespace
                prefix = _prefix(field_name)
                raise ConfigError(
                    f"{field_name}={addr!r}: an abstract ipc name has no file permissions, "
                    "so every local user could connect; bind an ipc path in a directory "
                    f"only you can enter (ipc:///run/user/UID/actbus.sock), or set "
                    f"{prefix}server_secret_key and {prefix}authorized_keys "
                    "(`actbus keys DIR`)"
                )
            raise ConfigError(
                f"{field_name}={addr!r}: ipc address needs a path, e.g. ipc:///tmp/actbus.sock"
            )
        parent = os.path.dirname(os.path.abspath(path)) or "/"
        if not os.path.isdir(parent):
            raise ConfigError(f"{field_name}={addr!r}: directory {parent} does not exist")
        return addr
    m = _TCP.fullmatch(addr)
    if m:
        port = m.group("port")
        if port != "*" and not 0 < int(port) < 65536:
            raise ConfigError(f"{field_name}={addr!r}: port must be 1..65535")
        host = m.group("host").strip("[]")
        if not (allow_remote or curve or insecure_allow_any_interface or _is_loopback(host)):
            prefix = _prefix(field_name)
            raise ConfigError(
                f"{field_name}={addr!r}: binding a non-loopback interface is refused without "
                f"CURVE keys; run `actbus keys DIR` and set {prefix}server_secret_key="
                f"DIR/server.key_secret and {prefix}authorized_keys=DIR/authorized_keys, or set "
                f"{prefix}insecure_allow_any_interface=true (anyone who reaches it reads the "
                "stream); or bind ipc:// or tcp://127.0.0.1:PORT"
            )
        return addr
    raise ConfigError(
        f"{field_name}={addr!r}: not a ZeroMQ address; use ipc:///path/to/socket "
        "or tcp://127.0.0.1:PORT"
    )


def is_loopback_address(addr: str) -> bool:
    """True for an ipc path and tcp:// on a loopback host: reachable from this machine
    only, and (ipc) only by who may open its file. An abstract ipc name is not: any
    local user reaches it."""
    if addr.startswith("ipc://@"):
        return False
    if addr.startswith(("ipc://", "inproc://")):
        return True
    m = _TCP.fullmatch(addr)
    return bool(m) and _is_loopback(m.group("host").strip("[]"))


def connectable(addr: str) -> str:
    """A bind address as this host connects to it (a wildcard bind: on loopback)."""
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    if addr.startswith("tcp://") and host in ("*", "0.0.0.0", "[::]"):
        return f"tcp://127.0.0.1:{port}"
    return addr


def _prefix(field_name: str) -> str:
    """``actbus.`` of ``actbus.publish``: where the fix's keys live."""
    return field_name.rpartition(".")[0] + "." if "." in field_name else ""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
