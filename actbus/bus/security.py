"""CURVE security for the bus: key files, who may bind where, and the handshake.

Everything cryptographic is ZeroMQ's own CURVE, through pyzmq's ``zmq.auth``:
certificate files (``create_certificates``/``load_certificate``) and the ZAP
authenticator thread that decides which client keys get in. This module only
checks the files early (so a bad path fails at config time, naming the field),
wires them onto sockets, and turns handshake failures into clear errors.

A CURVE server socket without a running ZAP handler admits *any* client that
knows the server's public key, so the authenticator is started before the
socket binds and stopped only after the socket is closed, and its check fails
closed on any error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from actbus.bus.addresses import check_address, is_loopback_address
from actbus.errors import ConfigError

log = logging.getLogger("actbus.security")

SERVER = "server"
AUTHORIZED_KEYS = "authorized_keys"
SECRET_MODE = 0o600
_IPC_PATH_MAX = 107
"""The longest path a Unix socket address holds (``sun_path`` less its NUL)."""


@dataclass(frozen=True)
class KeyFiles:
    """What ``actbus keys DIR`` wrote, and where each file goes."""

    server_public: Path  # copy to every subscriber host (``server_key``)
    server_secret: Path  # stays with the publisher (``actbus.server_secret_key``)
    authorized_keys: Path  # the publisher's directory of client public keys
    client_public: Path  # inside ``authorized_keys``
    client_secret: Path  # copy to that subscriber's host only (``client_secret_key``)


def generate_keys(directory: str | os.PathLike[str], client: str = "client") -> KeyFiles:
    """Create the server keypair (unless present) and a new client keypair in ``directory``.

    Keys are written in a private (0700) temporary directory, secret files set to
    0600, then moved into place, so a secret is never readable by others, even
    briefly. An existing client of the same name is never overwritten.
    """
    if not client or not client.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"--client={client!r}: use letters, digits, '-' and '_' only")
    if client == SERVER:
        raise ConfigError(f"--client={client!r}: the name {SERVER!r} is the publisher's")
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    auth_dir = root / AUTHORIZED_KEYS
    auth_dir.mkdir(mode=0o700, exist_ok=True)
    files = KeyFiles(
        server_public=root / f"{SERVER}.key",
        server_secret=root / f"{SERVER}.key_secret",
        authorized_keys=auth_dir,
        client_public=auth_dir / f"{client}.key",
        client_secret=root / f"{client}.key_secret",
    )
    for p in (files.client_public, files.client_secret):
        if p.exists():
            raise ConfigError(
                f"{p} exists; choose another --client NAME, or delete the old client's files"
            )
    with tempfile.TemporaryDirectory(dir=root, prefix=".keys-") as tmp:
        moves: list[tuple[str, Path]] = []
        if not files.server_secret.exists():
            pub, sec = zmq.auth.create_certificates(tmp, SERVER)
            moves += [(pub, files.server_public), (sec, files.server_secret)]
        elif not files.server_public.exists():
            raise ConfigError(
                f"{files.server_secret} exists without {files.server_public.name}; "
                "restore it or start from an empty directory"
            )
        pub, sec = zmq.auth.create_certificates(tmp, client)
        moves += [(pub, files.client_public), (sec, files.client_secret)]
        for src, dst in moves:
            os.chmod(src, SECRET_MODE if src.endswith("_secret") else 0o644)
            shutil.move(src, dst)
    return files


def load_public_key(path: str | os.PathLike[str], field_name: str) -> bytes:
    """The public key of a certificate file (public or secret), or a ConfigError."""
    return _load(path, field_name)[0]


def load_secret_key(path: str | os.PathLike[str], field_name: str) -> tuple[bytes, bytes]:
    """(public, secret) of a secret certificate file, or a ConfigError naming the field."""
    public, secret = _load(path, field_name)
    if secret is None:
        raise ConfigError(
            f"{field_name}={str(path)!r}: this is a public certificate; give the matching "
            "'.key_secret' file"
        )
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning(
            "%s=%r is readable by other users (mode %o); run `chmod 600 %s`",
            field_name,
            str(path),
            mode,
            path,
        )
    return public, secret


def load_authorized_keys(path: str | os.PathLike[str], field_name: str) -> set[bytes]:
    """The client public keys (z85) in a directory of ``*.key`` certificates."""
    if not os.path.isdir(path):
        raise ConfigError(
            f"{field_name}={str(path)!r}: no such directory; give the directory of client "
            f"public keys that `actbus keys DIR` made (DIR/{AUTHORIZED_KEYS})"
        )
    try:
        keys = set(zmq.auth.load_certificates(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field_name}={str(path)!r}: unreadable certificate: {e}") from None
    if not keys:
        raise ConfigError(
            f"{field_name}={str(path)!r}: holds no client public keys (*.key files); "
            "run `actbus keys DIR --client NAME` and copy DIR/authorized_keys/NAME.key here"
        )
    return keys


def _load(path: str | os.PathLike[str], field_name: str) -> tuple[bytes, bytes | None]:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{field_name}: expected a path to a certificate file, got {path!r}")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{field_name}={str(path)!r}: no such file; run `actbus keys DIR` to make keys"
        )
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{field_name}={str(path)!r}: not a ZeroMQ certificate ({e}); "
            "use the files `actbus keys DIR` makes"
        ) from None


def check_server_keys(
    server_secret_key: str | None = None,
    authorized_keys: str | None = None,
    *,
    prefix: str = "actbus.",
    load: bool = True,
) -> None:
    """Both or neither, and (with ``load``) both readable: fails at config time, not later."""
    if (server_secret_key is None) != (authorized_keys is None):
        given, missing = (
            ("server_secret_key", "authorized_keys")
            if authorized_keys is None
            else ("authorized_keys", "server_secret_key")
        )
        raise ConfigError(
            f"{prefix}{missing}: required with {prefix}{given}; `actbus keys DIR` makes "
            f"both (DIR/{SERVER}.key_secret and DIR/{AUTHORIZED_KEYS})"
        )
    if load and server_secret_key is not None and authorized_keys is not None:
        load_secret_key(server_secret_key, f"{prefix}server_secret_key")
        load_authorized_keys(authorized_keys, f"{prefix}authorized_keys")


def bind_private_ipc(sock: zmq.Socket, address: str, mode: int = SECRET_MODE) -> Path:
    """Bind ``sock`` to the ipc path of ``address`` so that the socket file has ``mode``
    from the moment anyone can reach it; the path bound.

    A socket file is made with the process's umask (not thread-safe to change), so
    chmod after bind leaves a window in which another local user can connect. Here the
    socket is bound inside a fresh directory only this user may enter (0700), set to
    ``mode`` there, and renamed into place: the connection keeps working (a socket is
    found by its file), and the path others see is never anything but ``mode``. The
    caller unlinks the path after closing the socket (ZeroMQ would unlink the
    temporary name)."""
    path = Path(address[len("ipc://") :]).absolute()
    private = tempfile.mkdtemp(prefix=".actbus-bind-", dir=path.parent)  # 0700
    try:
        inner = os.path.join(private, "s")
        if len(inner.encode()) > _IPC_PATH_MAX:
            raise ConfigError(
                f"{address}: the socket's directory {path.parent} is too deep to bind in "
                f"privately ({len(inner.encode())} > {_IPC_PATH_MAX} bytes of a path); use "
                "a shorter directory, e.g. /run/user/UID"
            )
        sock.bind(f"ipc://{inner}")
        os.chmod(inner, mode)
        os.rename(inner, path)  # atomic: replaces a stale file of a previous run
    except BaseException:
        with contextlib.suppress(zmq.ZMQError):
            sock.unbind(f"ipc://{os.path.join(private, 's')}")
        raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return path


class _AuthorizedKeys:
    """ZAP credentials provider: the keys in a directory, re-read when it changes.

    The directory's mtime changes whenever a file is added or removed, so a new
    subscriber's key can be dropped in (or an old one removed) while the engine
    serves; it applies to the next connection. Any error denies (fails closed).
    """

    def __init__(self, directory: str, field_name: str) -> None:
        self.directory = directory
        self.field_name = field_name
        self.keys = load_authorized_keys(directory, field_name)
        self._mtime = os.stat(directory).st_mtime_ns
        self.allowed = 0
        self.denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            with self._lock:
                mtime = os.stat(self.directory).st_mtime_ns
                if mtime != self._mtime:
                    self.keys = load_authorized_keys(self.directory, self.field_name)
                    self._mtime = mtime
                ok = key in self.keys
                if ok:
                    self.allowed += 1
                else:
                    self.denied += 1
        except Exception:  # never let the ZAP thread die: without it, anyone gets in
            log.exception("actbus: checking a client key failed; denied")
            self.denied += 1
            return False
        if not ok:
            log.warning(
                "actbus: refused a subscriber whose CURVE key %s is not in %s=%s",
                key.decode(errors="replace"),
                self.field_name,
                self.directory,
            )
        return ok


class ServerAuth:
    """The publisher's side: what it may bind, and CURVE with a ZAP authenticator.

    Construct before the socket (the checks raise ``ConfigError``), ``apply`` before
    ``bind``, ``close`` after the socket is closed and before the context ends.
    """

    def __init__(
        self,
        address: str,
        *,
        server_secret_key: str | None = None,
        authorized_keys: str | None = None,
        insecure_allow_any_interface: bool = False,
        prefix: str = "actbus.",
    ) -> None:
        check_server_keys(server_secret_key, authorized_keys, prefix=prefix, load=False)
        self.curve = server_secret_key is not None
        self.address = check_address(
            address,
            field_name=f"{prefix}publish",
            curve=self.curve,
            insecure_allow_any_interface=insecure_allow_any_interface,
        )
        self._keys: tuple[bytes, bytes] | None = None
        self._provider: _AuthorizedKeys | None = None
        self._auth: ThreadAuthenticator | None = None
        if server_secret_key is not None and authorized_keys is not None:
            self._keys = load_secret_key(server_secret_key, f"{prefix}server_secret_key")
            self._provider = _AuthorizedKeys(str(authorized_keys), f"{prefix}authorized_keys")
        elif not is_loopback_address(address):
            log.warning(
                "actbus: INSECURE: publishing on %s without CURVE keys because "
                "%sinsecure_allow_any_interface=true: anyone who can reach it can read every "
                "activation, and a 'block' subscriber can stall generation",
                address,
                prefix,
            )

    @property
    def denied(self) -> int:
        """Connections refused because their client key was not authorized."""
        return self._provider.denied if self._provider else 0

    def apply(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Start the authenticator and make ``sock`` a CURVE server (no-op without keys)."""
        if self._keys is None or self._provider is None:
            return
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("actbus.security.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self._provider)
        sock.curve_publickey, sock.curve_secretkey = self._keys
        sock.curve_server = True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


# Handshake failures a subscriber cannot fix by retrying, and what to tell the user.
_NO_DETAIL_LIMIT = 3


class ClientAuth:
    """The subscriber's side: CURVE client keys, and handshake failures made visible.

    Without it, a refused handshake looks like a publisher that never answers.
    The socket's events (zmq's socket monitor) report each handshake; ``failure``
    turns the definitive ones (key refused, one side without CURVE, a server key that
    does not match) into a message naming the fix. Works with or without keys.
    """

    def __init__(
        self,
        address: str,
        *,
        server_key: str | None = None,
        client_secret_key: str | None = None,
        fields: tuple[str, str] = ("server_key", "client_secret_key"),
    ) -> None:
        self.address = address
        self.fields = fields
        if (server_key is None) != (client_secret_key is None):
            missing = fields[1] if client_secret_key is None else fields[0]
            given = fields[0] if client_secret_key is None else fields[1]
            raise ConfigError(
                f"{missing}: required with {given}; CURVE needs both the server's public key "
                f"({SERVER}.key) and this subscriber's secret key (NAME.key_secret)"
            )
        self.server_key = server_key
        self._server_public = (
            load_public_key(server_key, fields[0]) if server_key is not None else None
        )
        self._client = (
            load_secret_key(client_secret_key, fields[1]) if client_secret_key is not None else None
        )
        self._socket_events: zmq.Socket | None = None
        self._sock: zmq.Socket | None = None
        self._no_detail = 0
        self._next_check = 0.0
        self.connected = False
        """Whether the watched socket's connection is up (a handshake succeeded and it
        has not closed since), as of the last ``failure`` call: a publisher that is
        silent but connected is alive and busy, not gone."""
        self._held: str | None = None  # a failure ``settle`` took early
        self.handshakes = 0
        """Successful handshakes so far: one more means a new connection, maybe to a
        publisher restarted at the same address, which must be subscribed to again."""

    @property
    def curve(self) -> bool:
        return self._client is not None

    def apply(self, sock: zmq.Socket, *, watch: bool = True) -> None:
        """Set the CURVE client keys (if any) on ``sock``; call before ``connect``.

        ``watch``: report this socket's handshake failures through ``failure`` (one
        socket per subscriber is watched: the one that carries the data).
        """
        if self._client is not None and self._server_public is not None:
            sock.curve_publickey, sock.curve_secretkey = self._client
            sock.curve_serverkey = self._server_public
        if not watch or self._socket_events is not None:
            return
        self._sock = sock
        self._socket_events = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_DISCONNECTED
        )

    def settle(self) -> None:
        """Take the socket's pending events now (``connected``, ``handshakes`` up to date),
        keeping a failure among them for the next ``failure`` call."""
        self._next_check = 0.0
        self._held = self.failure() or self._held

    def failure(self) -> str | None:
        """A definitive handshake failure since the last call, as a message; else None."""
        if self._held is not None:
            why, self._held = self._held, None
            return why
        now = time.monotonic()
        if self._socket_events is None or now < self._next_check:
            return None
        self._next_check = now + 0.05  # cheap enough for every recv, bounded anyway
        while True:
            try:
                ev = recv_monitor_message(self._socket_events, zmq.NOBLOCK)
            except zmq.Again:
                return None
            why = self._explain(int(ev["event"]), int(ev["value"]))
            if why:
                return why

    def _explain(self, event: int, value: int) -> str | None:
        where = f"publisher at {self.address}"
        if event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            return None
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._no_detail = 0
            self.connected = True
            self.handshakes += 1
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            public = self._client[0].decode() if self._client else "(none)"
            return (
                f"{where} refused this subscriber's CURVE key {public} (status {value}): "
                "it is not in the publisher's actbus.authorized_keys; copy this client's "
                "public certificate (NAME.key) into that directory"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                if self.curve:
                    return (
                        f"{where} does not use CURVE, but {self.fields[0]} and "
                        f"{self.fields[1]} are set; drop them, or configure "
                        "actbus.server_secret_key and actbus.authorized_keys on the publisher"
                    )
                return (
                    f"{where} requires CURVE keys; set {self.fields[0]} (the server's "
                    f"{SERVER}.key) and {self.fields[1]} (this subscriber's NAME.key_secret)"
                )
            return f"handshake with {where} failed: ZeroMQ protocol error {value:#x}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # The peer hung up mid-handshake (a reset can hide the reason from us).
            self._no_detail += 1
            if self._no_detail < _NO_DETAIL_LIMIT:
                return None
            if self.curve:
                return (
                    f"CURVE handshake with {where} failed {self._no_detail} times: its key is "
                    f"not the one in {self.fields[0]}={self.server_key!r}; copy the publisher's "
                    f"current {SERVER}.key"
                )
            return (
                f"handshake with {where} failed {self._no_detail} times: it requires CURVE "
                f"keys; set {self.fields[0]} (the server's {SERVER}.key) and {self.fields[1]} "
                "(this subscriber's NAME.key_secret)"
            )
        return None

    def close(self) -> None:
        """Stop watching; call before the socket's context ends."""
        if self._socket_events is not None:
            if self._sock is not None and not self._sock.closed:
                self._sock.disable_monitor()
            self._socket_events.close(linger=0)
            self._socket_events = None
