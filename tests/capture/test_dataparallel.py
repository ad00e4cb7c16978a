"""Data parallelism without an engine: the publish template, its refusals, the ranks
of a front end and of a worker (vLLM's own ``ParallelConfig``), and the rank in the
publisher's identity as a subscriber checks it."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from actbus.bus.endpoints import Endpoints, connect_spec, for_rank
from actbus.bus.subscriber import Subscriber
from actbus.config import CaptureConfig
from actbus.engine import dataparallel
from actbus.engine.dataparallel import of_args as data_parallel
from actbus.errors import ConfigError
from actbus.serve import serve_command
from actbus.wire import HELLO, SCHEMA_VERSION, WELCOME


def _cfg(publish: str, **kw) -> CaptureConfig:
    return CaptureConfig.from_dict({"publish": publish, "layers": [0], **kw})


def test_the_template_gives_each_rank_its_address_and_subscribers_their_range(tmp_path):
    ipc = f"ipc://{tmp_path}/actbus-{{dp_rank}}.sock"
    assert _cfg(ipc).check_data_parallel(3) == [
        f"ipc://{tmp_path}/actbus-{r}.sock" for r in range(3)
    ]
    tcp = _cfg("tcp://127.0.0.1:{5555+dp_rank}")
    assert [tcp.publish_address(r) for r in (0, 3)] == [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:5558",
    ]
    # The publishers' template and the subscribers' range are one grammar: what
    # connect_spec writes, --connect reads back as exactly the ranks' addresses.
    for template, ranks in ((ipc, [0, 1, 2, 3]), (tcp.publish, [2, 3]), (tcp.publish, [0, 2])):
        spec = connect_spec(template, ranks)
        assert Endpoints.parse(spec).current() == [for_rank(template, r) for r in ranks], spec
    assert connect_spec(ipc, [1]) == f"ipc://{tmp_path}/actbus-1.sock"
    # No rank in it: one engine, the address as given (rank 0 of a size-1 "fleet").
    plain = _cfg(f"ipc://{tmp_path}/one.sock")
    assert plain.check_data_parallel(1) == [plain.publish] == [plain.publish_address(5)]


def test_two_ranks_on_one_address_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"actbus\.publish=.*data_parallel_size=2.*\{dp_rank\}"):
        _cfg(f"ipc://{tmp_path}/one.sock").check_data_parallel(2)
    # Expansions that differ as text but are one socket file.
    clash = _cfg(f"ipc://{tmp_path}/d{{dp_rank}}/../x.sock")
    (tmp_path / "d0").mkdir()
    (tmp_path / "d1").mkdir()
    with pytest.raises(ConfigError, match=r"ranks 0 and 1 would both bind"):
        clash.check_data_parallel(2)
    # A rank whose port runs past 65535 is named with its rank.
    with pytest.raises(ConfigError, match=r"data-parallel rank 1\).*port must be"):
        _cfg("tcp://127.0.0.1:{65535+dp_rank}").check_data_parallel(2)
    bad = {
        "tcp://127.0.0.1:{dp_rank+5555}": "written {dp_rank} or {BASE+dp_rank}",
        "tcp://127.0.0.1:{5555..5556}": "a range is for subscribers",
        f"ipc://{tmp_path}/{{dp_rank}}-{{dp_rank}}": "one {A..B} range or {dp_rank}",
        f"ipc://{tmp_path}/{{dp_rank.sock": "unmatched brace",
    }
    for publish, why in bad.items():
        with pytest.raises(ConfigError, match=r"actbus\.publish") as e:
            _cfg(publish)
        assert why in str(e.value), (publish, str(e.value))
    # And the other way round: a subscriber given the publisher's template.
    with pytest.raises(ConfigError, match="publisher's template"):
        Endpoints.parse(f"ipc://{tmp_path}/actbus-{{dp_rank}}.sock")


def test_actbus_serve_refuses_before_the_engine_and_knows_its_ranks(tmp_path):
    one = f"ipc://{tmp_path}/a.sock"
    with pytest.raises(ConfigError, match="data_parallel_size=2"):
        serve_command(["m", "--publish", one, "--data-parallel-size", "2"])
    many = f"ipc://{tmp_path}/a-{{dp_rank}}.sock"
    assert serve_command(["m", "--publish", many, "-dp", "2"])
    assert data_parallel(["-dp", "4"]) == (4, [0, 1, 2, 3])
    assert data_parallel(["--data-parallel-size=4", "--data-parallel-rank", "2"]) == (4, [2])
    assert data_parallel(["-dp", "4", "-dpl", "2", "--data-parallel-start-rank", "2"]) == (
        4,
        [2, 3],
    )
    assert data_parallel(["--port", "8000"]) == (1, [0])


def _parallel(**kw):
    from vllm.config import ParallelConfig

    return ParallelConfig(**kw)


class _Config:
    """What the capture code reads of a ``VllmConfig``: its parallel config and the
    actbus entry (the model config is not needed to place a rank)."""

    def __init__(self, pc, size: int = 1) -> None:
        self.parallel_config = pc
        self.additional_config = {"actbus": {"layers": [0], dataparallel.SIZE_KEY: size}}


def test_ranks_as_vllm_gives_them():
    # As EngineArgs.create_engine_config fills them in for one node of two ranks.
    one_node = _parallel(data_parallel_size=2, data_parallel_size_local=2)
    internal = dataparallel.of_config(_Config(one_node))
    assert (internal.size, internal.local, internal.served, internal.remote) == (
        2,
        (0, 1),
        (0, 1),
        (),
    )
    # A multi-node front end (internal load balancing): ranks 2, 3 run elsewhere.
    head = _parallel(data_parallel_size=4, data_parallel_size_local=2)
    assert dataparallel.of_config(_Config(head)).remote == (2, 3)
    # A second node's hybrid front end serves its own ranks only.
    node = _parallel(
        data_parallel_size=4,
        data_parallel_size_local=2,
        data_parallel_rank=2,
        data_parallel_hybrid_lb=True,
    )
    assert dataparallel.of_config(_Config(node)) == dataparallel.DataParallel(4, (2, 3), (2, 3))
    # A dense model's engine core is made to look like DP=1; the index keeps the rank.
    core = _parallel(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rank=3)
    core.data_parallel_rank_local = 1
    core.reconfigure_for_independent_dp_rank()
    assert (core.data_parallel_size, core.data_parallel_rank) == (1, 0)
    assert dataparallel.worker_rank(_Config(core, size=4)) == 3
    assert dataparallel.front_size(_Config(core, size=4)) == 4


@pytest.mark.timeout(60)
def test_a_welcome_with_a_bad_rank_is_rejected_and_a_good_one_names_it(tmp_path):
    """The rank is checked at decode like every header field: a hostile WELCOME is
    counted under its field and ignored; a good one puts the rank on ``source``."""
    address = f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(address)
    sub = Subscriber(address, silence_s=60, keepalive=False)
    try:
        deadline = time.monotonic() + 10
        ident = None
        while ident is None:
            assert fake.poll(int(max(0, deadline - time.monotonic()) * 1000)), "no HELLO"
            frames = fake.recv_multipart()
            ident = frames[0] if frames[1] == HELLO else None
        base = {"schema": SCHEMA_VERSION, "heartbeat_s": 5.0, "next_seq": 0}
        for body in (
            {"publisher_id": "p", "dp_rank": -1},
            {"publisher_id": "p", "dp_rank": "1"},
            {"publisher_id": "p" * 65, "dp_rank": 1},
            {"publisher_id": "p", "dp_rank": 1},
        ):
            fake.send_multipart([ident, WELCOME, msgpack.packb({**base, **body})])
        welcome = sub.wait_welcome(10)
        assert welcome["dp_rank"] == 1
        assert sub.stats.rejected_by == {"dp_rank": 2, "publisher_id": 1}
        assert (sub.source.publisher_id, sub.source.dp_rank) == ("p", 1)
        assert str(sub.source).endswith("#p (dp rank 1)")
    finally:
        sub.close()
        fake.close()
        ctx.term()
