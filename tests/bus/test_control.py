"""The control endpoint alone (no engine): real sockets, real CURVE handshakes.

What a push must be (shape, finite values, known monitor, increasing version) and
who may send one; a refused push changes nothing. The engine side (scores after a
push) is tests/monitor/test_monitor_push.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from actbus.bus.control import ControlClient, ControlConfig, ControlServer, PushRefused
from actbus.bus.pushwire import Slot
from actbus.bus.security import generate_keys
from actbus.errors import ConfigError
from tests.support.procs import free_port

SLOTS = {"p": Slot(1, 8, "sigmoid"), "j": Slot(3, 8, "jumprelu")}


@pytest.fixture
def server(tmp_path):
    srv = ControlServer(ControlConfig(f"ipc://{tmp_path}/c.sock"), SLOTS, {"p": 1, "j": 1})
    yield srv
    srv.close()


def test_pushes_are_numbered_checked_and_coalesced(server, tmp_path):
    with ControlClient(server.cfg.address, timeout_s=5) as c:
        w = np.arange(8, dtype=np.float32)
        assert c.push("p", w, [0.5])["version"] == 2
        assert c.push("p", w * 2, [0.5])["version"] == 3  # replaces the pending 2
        assert c.push("j", np.ones((3, 8)), [0, 1, 2], [0.1, 0.2, 0.3], version=10)["version"] == 10
        bad = [
            (("q", w, [0.0]), "monitor", "no monitor named 'q'"),
            (("p", np.ones(7), [0.0]), "weight", "shape [1, 7] does not fit monitor 'p'"),
            (("p", w, [np.nan]), "bias", "holds NaN or Inf"),
            (("p", np.full(8, np.inf), [0.0]), "weight", "holds NaN or Inf"),
            (("p", w, [0.0, 1.0]), "bias", "8 bytes; monitor 'p' takes 1 float32"),
            (("j", np.ones((3, 8)), [0, 1, 2]), "frames", "takes weight, bias and threshold"),
            (("p", w, [0.0], [1.0]), "frames", "takes weight and bias (no threshold)"),
            (("j", np.ones((3, 8)), [0, 1, 2], [0, 0, 0], 10), "version", "10 is not above"),
        ]
        for args, field, msg in bad:
            with pytest.raises(PushRefused, match=re.escape(msg)) as e:
                c.push(*args)
            assert e.value.field == field
        st = c.status()
    assert st["monitors"] == {"p": {"version": 3, "in_use": 1}, "j": {"version": 10, "in_use": 1}}
    assert (st["accepted"], st["refused"], st["superseded"]) == (3, len(bad), 1)
    taken = {p.name: p for p in server.take()}
    assert set(taken) == {"p", "j"} and taken["p"].version == 3
    np.testing.assert_array_equal(taken["p"].weight[0], w * 2)  # the latest, not the first
    np.testing.assert_array_equal(taken["j"].theta, np.float32([0.1, 0.2, 0.3]))
    assert server.take() == []
    swaps = server.status()["swaps"]
    assert [(s["monitor"], s["version"]) for s in swaps] == [("p", 3), ("j", 10)]
    assert all(0 <= s["swap_ms"] < 60_000 for s in swaps)


def test_curve_refuses_peers_without_an_authorized_key(tmp_path):
    keys = generate_keys(tmp_path / "keys", client="trainer")
    other = generate_keys(tmp_path / "other", client="stranger")
    cfg = ControlConfig.from_raw(
        {
            "address": "tcp://127.0.0.1:0".replace(":0", f":{free_port()}"),
            "server_secret_key": str(keys.server_secret),
            "authorized_keys": str(keys.authorized_keys),
        },
        {},
    )
    srv = ControlServer(cfg, SLOTS, {"p": 1, "j": 1})
    try:
        w = np.zeros(8, dtype=np.float32)
        stranger = ControlClient(
            cfg.address,
            server_key=str(keys.server_public),
            client_secret_key=str(other.client_secret),
            timeout_s=5,
        )
        for c, why in ((ControlClient(cfg.address, timeout_s=3), r"CURVE|control endpoint"),
                       (stranger, r"refused this subscriber's CURVE key")):  # fmt: skip
            with c, pytest.raises((PermissionError, TimeoutError), match=why):
                c.push("p", w, [0.0])
        assert srv.status()["accepted"] == 0 and srv.take() == []
        with ControlClient(
            cfg.address,
            server_key=str(keys.server_public),
            client_secret_key=str(keys.client_secret),
            timeout_s=5,
        ) as c:
            assert c.push("p", w, [0.0])["version"] == 2
    finally:
        srv.close()


def test_config_refuses_an_open_interface_without_keys():
    with pytest.raises(ConfigError, match=r"actbus\.control\.address=.*refused without CURVE keys"):
        ControlConfig.from_raw("tcp://0.0.0.0:5999", {})
    with pytest.raises(ConfigError, match=r"actbus\.control\.bogus: unknown key"):
        ControlConfig.from_raw({"address": "ipc:///tmp/x.sock", "bogus": 1}, {})


def test_live_vector_pushes_share_the_endpoint_and_its_rules(tmp_path):
    """A live steering vector's push: numbered per vector (apart from a monitor of the
    same name), checked for width and finite values, coalesced while pending."""
    srv = ControlServer(
        ControlConfig(f"ipc://{tmp_path}/v.sock"), SLOTS, {"p": 1, "j": 1}, {"p": 8, "dir": 8}
    )
    try:
        with ControlClient(srv.cfg.address, timeout_s=5) as c:
            v = np.linspace(-1, 1, 8, dtype=np.float32)
            reply = c.push_vector("dir", v)
            assert (reply["vector"], reply["version"], "monitor" in reply) == ("dir", 2, False)
            assert c.push_vector("dir", v * 3)["version"] == 3  # replaces the pending 2
            assert c.push_vector("p", v, version=7)["version"] == 7  # the vector, not monitor p
            assert c.push("p", v, [0.0])["version"] == 2  # monitor p counts on its own
            bad = [
                (("nope", v), "vector", "no live steering vector named 'nope' on this engine "
                 "(known: dir, p)"),
                (("dir", v[:-1]), "values", "shape [7] does not fit live vector 'dir': it "
                 "takes [8]"),
                (("dir", np.where(np.arange(8) == 2, np.nan, v)), "values", "holds NaN or Inf"),
                (("dir", v, 3), "version", "3 is not above live vector 'dir''s current version 3"),
            ]  # fmt: skip
            for args, field, msg in bad:
                with pytest.raises(PushRefused, match=re.escape(msg)) as e:
                    c.push_vector(*args)
                assert e.value.field == field
            st = c.status()
        assert st["vectors"] == {
            "dir": {"version": 3, "in_use": 1},
            "p": {"version": 7, "in_use": 1},
        }
        assert st["monitors"]["p"] == {"version": 2, "in_use": 1}
        assert (st["accepted"], st["refused"], st["superseded"]) == (4, len(bad), 1)
        taken = {(p.kind, p.name): p for p in srv.take()}
        assert set(taken) == {("vector", "dir"), ("vector", "p"), ("monitor", "p")}
        np.testing.assert_array_equal(taken["vector", "dir"].weight, v * 3)
        assert srv.status()["vectors"]["dir"] == {"version": 3, "in_use": 3}
        swaps = srv.status()["swaps"]
        assert {(s.get("vector"), s.get("monitor"), s["version"]) for s in swaps} == {
            ("dir", None, 3), ("p", None, 7), (None, "p", 2)
        }  # fmt: skip
    finally:
        srv.close()
