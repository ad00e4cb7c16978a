"""END when the engine's shutdown kills its publisher first (vLLM 0.26 on a GPU stops
its engine core with SIGTERM and no grace): the front end's shutdown tells the
subscribers, so trainers and ``--exit-on-end`` consumers do not wait forever."""

from __future__ import annotations

import os
import signal
import time

from actbus.bus import Event, Subscriber, Subscription
from tests.support.bus_procs import Proc


def _vllm_config(model, address: str):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model),
        gpu_memory_utilization=0.3,
        additional_config={"actbus": {"layers": [0], "publish": address}},
    )
    return args.create_engine_config()


def _until_end(sub: Subscriber, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = sub.recv(timeout=0.2)
        if isinstance(out, Event) and out.kind == "end":
            return out.body
    return None


def test_shutdown_tells_the_subscribers_of_a_killed_publisher(tiny_models, tmp_path):
    from vllm.v1.engine.core_client import MPClient

    import actbus.engine.plugin

    actbus.engine.plugin.register()
    assert getattr(MPClient.shutdown, "__wrapped__", None) is not None  # the front end's hook
    from actbus.engine.frontend import _farewell

    address = f"ipc://{tmp_path}/bus.sock"
    config = _vllm_config(tiny_models["llama"], address)
    pub = Proc("publisher", address, "50")
    sub = Subscriber(address, Subscription(name="trainer"), silence_s=1.0)
    try:
        pub.ready(1)
        sub.wait_welcome(30)
        os.kill(pub.popen.pid, signal.SIGKILL)  # as the engine core dies: no END
        pub.popen.wait(timeout=10)
        assert os.path.exists(f"{tmp_path}/bus.sock")  # what a killed publisher leaves
        t0 = time.monotonic()
        _farewell(config)
        assert time.monotonic() - t0 < 10
        body = _until_end(sub, 10)
        assert body is not None and body["reason"] == "the engine stopped"
    finally:
        sub.close()
        if pub.popen.poll() is None:
            pub.popen.kill()


def test_a_publisher_that_ended_cleanly_needs_no_farewell(tiny_models, tmp_path):
    from actbus.bus import Publisher
    from actbus.engine.frontend import _farewell

    address = f"ipc://{tmp_path}/bus.sock"
    config = _vllm_config(tiny_models["llama"], address)
    pub = Publisher(address, info={"model": "t"}, heartbeat_s=0.1)
    sub = Subscriber(address, Subscription(name="consumer"))
    try:
        sub.wait_welcome(30)
        pub.close(timeout=5)
        assert _until_end(sub, 10) is not None  # the publisher's own END
        assert not os.path.exists(f"{tmp_path}/bus.sock")  # and its socket file is gone
        t0 = time.monotonic()
        _farewell(config)
        assert time.monotonic() - t0 < 1.0  # nothing to announce, no wait
    finally:
        sub.close()
        pub.close()
