"""CURVE security over real sockets: keys from `actbus keys`, refused binds, refused keys."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq.auth

from actbus.bus import Batch, Publisher, Subscriber, Subscription, SubscriptionRejected
from actbus.bus.options import SubscriberOptions
from actbus.bus.security import generate_keys
from actbus.config import CaptureConfig
from actbus.errors import ConfigError
from actbus.wire import Header, RowIndex
from tests.support.procs import ROOT, free_port, recv_batches, wait_for


def _keys(directory: Path, *clients: str) -> Path:
    """What `actbus keys DIR --client NAME` writes (the command itself is tested below)."""
    for client in clients or ("client",):
        generate_keys(directory, client)
    return directory


def _actbus_keys(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "actbus.cli", "keys", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return _keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> Path:
    """A second, unrelated set: its server and client are strangers to ``keys``."""
    return _keys(tmp_path_factory.mktemp("other-keys"))


def _msg(step: int, rows: int = 4, hidden: int = 32):
    ri = RowIndex(["r"], np.array([0, rows]), np.arange(rows), np.arange(rows))
    hdr = Header(step, 0, "post_block", "float32", (rows, hidden), "test", ri)
    return hdr, torch.full((rows, hidden), float(step))


def _refused(sub: Subscriber, timeout: float) -> tuple[str, list[Batch]]:
    """Read until the subscriber raises; a hang past ``timeout`` fails the test."""
    got: list[Batch] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = sub.recv(timeout=0.2)
        except SubscriptionRejected as e:
            return str(e), got
        if isinstance(out, Batch):
            got.append(out)
    raise AssertionError(f"subscriber neither refused nor failed within {timeout}s; got {got}")


def _curve_publisher(keys: Path, address: str) -> Publisher:
    return Publisher(
        address,
        info={"model": "test"},
        heartbeat_s=0.1,
        server_secret_key=str(keys / "server.key_secret"),
        authorized_keys=str(keys / "authorized_keys"),
    )


def _client(keys: Path, name: str = "client") -> dict[str, str]:
    return {
        "server_key": str(keys / "server.key"),
        "client_secret_key": str(keys / f"{name}.key_secret"),
    }


# ------------------------------------------------------------------------- keys


def test_keys_command_writes_private_certificates(tmp_path):
    d = tmp_path / "k"
    out = _actbus_keys(str(d))
    assert out.returncode == 0, out.stderr
    assert f"--server-key {d}/server.key --client-secret-key {d}/client.key_secret" in out.stdout
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(d / secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    server_pub, server_sec = zmq.auth.load_certificate(d / "server.key_secret")
    assert server_sec and zmq.auth.load_certificate(d / "server.key") == (server_pub, None)
    client_pub, client_sec = zmq.auth.load_certificate(d / "client.key_secret")
    assert client_sec and set(zmq.auth.load_certificates(d / "authorized_keys")) == {client_pub}
    assert not list(d.glob(".keys-*")), "temporary directory left behind"

    with pytest.raises(ConfigError, match="choose another --client NAME"):
        generate_keys(d)  # never overwrites a client's keys
    _keys(d, "rank1")  # a second subscriber: new client key, same server key
    assert zmq.auth.load_certificate(d / "server.key_secret") == (server_pub, server_sec)
    assert len(zmq.auth.load_certificates(d / "authorized_keys")) == 2


# --------------------------------------------------------------- refused binds


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "192.0.2.7", "[::]"])
def test_non_loopback_bind_without_keys_is_refused(host):
    address = f"tcp://{host}:{free_port()}"
    with pytest.raises(ConfigError) as e:
        Publisher(address, info={})
    msg = str(e.value)
    assert msg.startswith(f"actbus.publish={address!r}: binding a non-loopback interface")
    for fix in ("actbus keys DIR", "actbus.server_secret_key", "insecure_allow_any_interface"):
        assert fix in msg
    with pytest.raises(ConfigError, match="non-loopback interface is refused"):
        CaptureConfig.from_dict({"layers": [0], "publish": address})
    if host in ("0.0.0.0", "*"):  # nothing was left bound: the same port binds afterwards
        Publisher(address, info={}, insecure_allow_any_interface=True).close(timeout=1)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5599\n", "ipc:///tmp/x.sock\n"])
def test_an_address_with_a_trailing_newline_is_refused(address):
    with pytest.raises(ConfigError, match=r"actbus.publish=.*control characters"):
        CaptureConfig.from_dict({"layers": [0], "publish": address})
    with pytest.raises(ConfigError, match="control characters"):
        Publisher(address, info={})


def test_an_abstract_ipc_name_needs_keys(keys):
    """``ipc://@name`` has no file, so no permissions: every local user could connect."""
    address = f"ipc://@actbus-test-{os.getpid()}"
    with pytest.raises(ConfigError) as e:
        CaptureConfig.from_dict({"layers": [0], "publish": address})
    msg = str(e.value)
    assert msg.startswith(f"actbus.publish={address!r}: an abstract ipc name has no file")
    for fix in ("ipc:///run/user/UID/actbus.sock", "actbus.server_secret_key", "actbus keys DIR"):
        assert fix in msg
    with pytest.raises(ConfigError, match="abstract ipc name"):
        Publisher(address, info={})
    # With keys it binds, and only an authorized subscriber gets in; connecting is fine.
    assert SubscriberOptions(connect=address).connect == address
    pub = _curve_publisher(keys, address)
    try:
        with Subscriber(address, Subscription(name="abstract"), **_client(keys)) as sub:
            sub.wait_welcome(10)
            pub.publish(*_msg(0))
            assert [b.step for b in recv_batches(sub, 1)] == [0]
    finally:
        pub.close(timeout=2)


def test_insecure_flag_binds_any_interface_with_a_loud_warning(caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="actbus.security"):
        pub = Publisher(
            f"tcp://0.0.0.0:{port}",
            info={"model": "test"},
            heartbeat_s=0.1,
            insecure_allow_any_interface=True,
        )
    try:
        assert any("INSECURE" in r.getMessage() for r in caplog.records)
        with Subscriber(f"tcp://127.0.0.1:{port}", Subscription(name="plain")) as sub:
            sub.wait_welcome(10)
            pub.publish(*_msg(0))
            assert [b.step for b in recv_batches(sub, 1)] == [0]
    finally:
        pub.close(timeout=2)
    cfg = CaptureConfig.from_dict(
        {"layers": [0], "publish": "tcp://0.0.0.0:5555", "insecure_allow_any_interface": True}
    )
    assert cfg.insecure_allow_any_interface
    with pytest.raises(ConfigError, match="insecure_allow_any_interface: expected true or false"):
        CaptureConfig.from_dict({"layers": [0], "insecure_allow_any_interface": "yes"})


# ------------------------------------------------------------ CURVE connections


def test_curve_on_any_interface_delivers_to_an_authorized_subscriber(keys):
    port = free_port()
    pub = _curve_publisher(keys, f"tcp://0.0.0.0:{port}")
    try:
        with Subscriber(
            f"tcp://127.0.0.1:{port}", Subscription(window=4, name="ok"), **_client(keys)
        ) as sub:
            assert sub.wait_welcome(10)["model"] == "test"
            for i in range(50):
                pub.publish(*_msg(i))
            got = recv_batches(sub, 50)
        assert [b.step for b in got] == list(range(50)) and sub.stats.missed == 0
        assert all(float(b.tensor[0, 0]) == b.step for b in got)
        assert pub.stats()["auth_denied"] == 0
    finally:
        pub.close(timeout=2)


def test_curve_over_ipc(keys, tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = _curve_publisher(keys, address)
    try:
        with Subscriber(address, Subscription(name="ipc"), **_client(keys)) as sub:
            sub.wait_welcome(10)
            for i in range(5):
                pub.publish(*_msg(i))
            assert [b.step for b in recv_batches(sub, 5)] == list(range(5))
    finally:
        pub.close(timeout=2)


def test_unauthorized_client_key_is_refused_clearly_and_costs_others_nothing(keys, other_keys):
    port = free_port()
    pub = _curve_publisher(keys, f"tcp://0.0.0.0:{port}")
    address = f"tcp://127.0.0.1:{port}"
    good = Subscriber(address, Subscription(window=4, name="good"), **_client(keys))
    try:
        good.wait_welcome(10)
        # Right server key, but a client key the publisher never authorized.
        stranger = Subscriber(
            address,
            Subscription(name="stranger"),
            server_key=str(keys / "server.key"),
            client_secret_key=str(other_keys / "client.key_secret"),
        )
        try:
            for i in range(10):
                pub.publish(*_msg(i))
            t0 = time.monotonic()
            why, got = _refused(stranger, timeout=10)
            assert time.monotonic() - t0 < 5
        finally:
            stranger.close()
        assert got == [] and stranger.welcome is None
        assert "refused this subscriber's CURVE key" in why and "authorized_keys" in why
        assert pub.stats()["auth_denied"] >= 1
        assert "stranger" not in pub.stats()["subscribers"]
        assert [b.step for b in recv_batches(good, 10)] == list(range(10))
    finally:
        good.close()
        pub.close(timeout=2)


def test_wrong_server_key_gets_no_data_and_fails_in_bounded_time(keys, other_keys):
    port = free_port()
    pub = _curve_publisher(keys, f"tcp://0.0.0.0:{port}")
    try:
        sub = Subscriber(
            f"tcp://127.0.0.1:{port}",
            Subscription(name="wrong-server"),
            server_key=str(other_keys / "server.key"),  # not this publisher's key
            client_secret_key=str(keys / "client.key_secret"),
        )
        try:
            for i in range(5):
                pub.publish(*_msg(i))
            t0 = time.monotonic()
            why, got = _refused(sub, timeout=10)
            assert time.monotonic() - t0 < 5
        finally:
            sub.close()
        assert got == [] and "its key is not the one in server_key" in why
        assert pub.stats()["subscribers"] == {}
    finally:
        pub.close(timeout=2)


def test_subscriber_without_keys_is_told_the_publisher_needs_them(keys, tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = _curve_publisher(keys, address)
    try:
        with Subscriber(address, Subscription(name="keyless")) as sub:
            why, got = _refused(sub, timeout=10)
        assert got == [] and "requires CURVE keys; set server_key" in why
    finally:
        pub.close(timeout=2)


def test_authorized_keys_added_while_serving_apply_to_the_next_connection(keys, tmp_path):
    auth = tmp_path / "authorized"
    auth.mkdir()
    shutil.copy(keys / "authorized_keys" / "client.key", auth)
    late = _keys(tmp_path / "late")
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(
        address,
        info={"model": "test"},
        heartbeat_s=0.1,
        server_secret_key=str(keys / "server.key_secret"),
        authorized_keys=str(auth),
    )
    client = {"server_key": str(keys / "server.key")}
    try:
        with Subscriber(
            address, client_secret_key=str(late / "client.key_secret"), **client
        ) as sub:
            _refused(sub, timeout=10)
        shutil.copy(late / "authorized_keys" / "client.key", auth / "late.key")
        with Subscriber(
            address, client_secret_key=str(late / "client.key_secret"), **client
        ) as sub:
            sub.wait_welcome(10)
            pub.publish(*_msg(0))
            assert len(recv_batches(sub, 1)) == 1
        wait_for(lambda: pub.stats()["subscribers"] == {}, 10, "the subscriber to leave")
    finally:
        pub.close(timeout=2)


# ------------------------------------------------------------ config-time checks


def test_key_paths_are_checked_at_config_time(keys, tmp_path):
    ok = {
        "layers": [0],
        "publish": "tcp://0.0.0.0:5555",
        "server_secret_key": str(keys / "server.key_secret"),
        "authorized_keys": str(keys / "authorized_keys"),
    }
    cfg = CaptureConfig.from_dict(ok)
    assert cfg.server_secret_key == str(keys / "server.key_secret")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ({"server_secret_key": str(tmp_path / "nope")}, "actbus.server_secret_key='"),
        ({"server_secret_key": str(keys / "server.key")}, "this is a public certificate"),
        ({"authorized_keys": str(tmp_path / "nope")}, "actbus.authorized_keys='"),
        ({"authorized_keys": str(empty)}, "holds no client public keys"),
    ]
    for change, needle in cases:
        with pytest.raises(ConfigError) as e:
            CaptureConfig.from_dict({**ok, **change})
        assert needle in str(e.value)
    with pytest.raises(ConfigError, match=r"actbus.authorized_keys: required with actbus.server"):
        CaptureConfig.from_dict({"layers": [0], "server_secret_key": ok["server_secret_key"]})
    with pytest.raises(ConfigError, match=r"actbus.server_secret_key='.*': no such file"):
        Publisher(
            "ipc:///tmp/x.sock",
            info={},
            server_secret_key=str(tmp_path / "nope"),
            authorized_keys=ok["authorized_keys"],
        )
    with pytest.raises(ConfigError, match=r"^server_key='.*': no such file"):
        Subscriber(
            "ipc:///tmp/x.sock",
            server_key=str(tmp_path / "nope"),
            client_secret_key=str(keys / "client.key_secret"),
        )
    with pytest.raises(ConfigError, match=r"^client_secret_key: required with server_key"):
        Subscriber("ipc:///tmp/x.sock", server_key=str(keys / "server.key"))


# ------------------------------------------------------------------- actbus run


def test_actbus_run_with_keys_and_with_a_refused_key(keys, other_keys, tmp_path):
    """`actbus run --server-key --client-secret-key`: delivered; a stranger's key: exit 1, named."""
    port = free_port()
    pub = _curve_publisher(keys, f"tcp://0.0.0.0:{port}")
    address = f"tcp://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "actbus.cli", "run", "null", "--connect", address]
    cmd += ["--server-key", str(keys / "server.key"), "--client-secret-key"]
    good = subprocess.Popen(
        [*cmd, str(keys / "client.key_secret"), "--exit-on-end"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        stranger = subprocess.run(
            [*cmd, str(other_keys / "client.key_secret")],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert stranger.returncode == 1
        assert "refused this subscriber's CURVE key" in stranger.stderr
        wait_for(lambda: "null" in pub.stats()["subscribers"], 30, "the keyed consumer")
        for i in range(7):
            pub.publish(*_msg(i))
        pub.close(timeout=5)
        out, err = good.communicate(timeout=30)
    finally:
        good.kill()
        pub.close(timeout=2)
    assert good.returncode == 0, err
    assert '"messages": 7' in out
