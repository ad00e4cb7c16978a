"""A run across the life of its streams: a sink started before its publisher, a trickle
of small steps, a server restarted under a running sink, and a stored run filtered by
``--match`` as the live stream would be. Real publishers, real ``actbus run fs-sink``
processes, real files."""

from __future__ import annotations

import threading
import time

import pytest

from actbus.bus import Batch, Subscriber, Subscription
from actbus.bus.options import SubscriberOptions
from consumers.fs import ActivationRun
from consumers.fs.replay import ReplayConfig, replay
from consumers.fs.torch_dataset import TokenDataset
from tests.support.fs_procs import log_of, publisher, sink, step_message, wait_exit, wait_sent
from tests.support.procs import manifest, start_sink, stop, wait_for


def test_a_sink_started_before_its_publisher_counts_one_session(tmp_path):
    """Its HELLOs, queued while no publisher was there, are answered all at once: one
    subscription, one session (was one WELCOME, one session, per queued HELLO)."""
    out, address = tmp_path / "run", f"ipc://{tmp_path}/bus.sock"
    proc = start_sink(address, out, "--exit-on-end")
    try:
        time.sleep(5.0)  # about five HELLOs queued
        pub = publisher(address)
        try:
            wait_for(lambda: "fs-sink" in pub.stats()["subscribers"], 30, "the sink")
            time.sleep(1.0)  # every queued HELLO answered
            pub.publish(*step_message(0, [("a", 0, 0, {})]))
            wait_sent(pub, "fs-sink", 1)
        finally:
            pub.close()
        assert wait_exit(proc, out) == 0, log_of(out)
    finally:
        stop(proc)
    m = manifest(out)
    assert m["sessions"] == 1, m
    assert m["total_rows"] == 4 and len(m["streams"]) == 1


def test_a_trickle_of_small_steps_makes_few_shards(tmp_path):
    """The sink is caught up after nearly every step; shards still rotate only by size
    and age (was one shard per caught-up heartbeat)."""
    out = tmp_path / "run"
    pub = publisher(f"ipc://{tmp_path}/bus.sock")
    steps = 120
    try:
        proc = sink(pub.address, out, "--flush-s", "30")
        for s in range(steps):  # 3 s of one-request steps, 4 rows each
            pub.publish(*step_message(s, [(f"r{s}", 0, 0, {})]))
            time.sleep(0.025)
        wait_sent(pub, "fs-sink", steps)
    finally:
        pub.close()
    assert wait_exit(proc, out) == 0, log_of(out)
    run = ActivationRun(out)
    assert run.manifest["total_rows"] == 4 * steps and run.verify() == []
    assert len(run.manifest["shards"]) == 1, [s["rows"] for s in run.manifest["shards"]]


def _publish_session(address: str, prefix: str, steps: int) -> None:
    """One publisher's life: ``steps`` steps of two requests named ``prefix``N, then END."""
    pub = publisher(address)
    try:
        wait_for(lambda: "fs-sink" in pub.stats()["subscribers"], 30, "the sink to subscribe")
        for s in range(steps):
            reqs = [(f"{prefix}0", 0, 4 * s, {"session": prefix}), (f"{prefix}1", 0, 4 * s, {})]
            pub.publish(*step_message(s, reqs))
        wait_sent(pub, "fs-sink", steps)
    finally:
        pub.close()


def _replayed(run_dir, tmp_path) -> list[Batch]:
    address = f"ipc://{tmp_path}/replay.sock"
    done: dict = {}
    t = threading.Thread(
        target=lambda: done.update(replay(ReplayConfig(run_dir, address, wait_s=30))), daemon=True
    )
    t.start()
    got: list[Batch] = []
    with Subscriber(address, Subscription(name="check")) as sub:
        for batch in sub:  # until the replay's END
            got.append(batch)
    t.join(timeout=30)
    assert done, "the replay did not finish"
    return got


def test_replay_keeps_two_server_sessions_of_one_run_apart(tmp_path):
    """A server restarted under a running sink: both sessions number steps from 0. The
    run records two streams, no shard holds both, and replay publishes the first
    session's steps, then the second's, never one message of both (was: step N of each
    merged into one message)."""
    out, address = tmp_path / "run", f"ipc://{tmp_path}/bus.sock"
    proc = start_sink(address, out, "--flush-s", "30", "--keep-waiting")  # past the first END
    try:
        _publish_session(address, "a", 3)
        _publish_session(address, "b", 3)
        wait_for(lambda: (manifest(out) or {}).get("sessions") == 2, 30, "the second session")
    finally:
        assert stop(proc) == 0, log_of(out)
    run = ActivationRun(out)
    assert run.manifest["total_rows"] == 48 and len(run.manifest["streams"]) == 2
    assert sorted(s["stream"] for s in run.manifest["shards"]) == [0, 1]
    got = _replayed(out, tmp_path)
    steps = [b.step for b in got]
    owners = [{r[0] for r in b.header.rows.request_ids} for b in got]
    assert len(got) == 6 and steps == sorted(set(steps)), steps
    assert owners == [{"a"}] * 3 + [{"b"}] * 3, owners
    assert sum(b.header.rows.num_rows for b in got) == 48


def test_a_stored_run_is_filtered_by_match_as_the_live_stream_is(tmp_path):
    """``TokenDataset(match=...)`` (what ``actbus run sae --from RUN --match`` reads
    through) keeps the rows a live ``--match`` subscriber gets, by the same rule: all
    keys must match, a list accepts any of its values, ``1`` is not ``true``."""
    out, address = tmp_path / "run", f"ipc://{tmp_path}/bus.sock"
    tags = [{"split": "train", "n": 1}, {"split": "eval", "n": 1}, {"split": "train", "n": True}]
    match = {"split": ["train", "dev"], "n": 1}
    pub = publisher(address)
    try:
        proc = sink(address, out)
        opts = SubscriberOptions(connect=address, match=match, name="live")
        live = opts.subscribe(opts.subscription())
        live.wait_welcome(10)
        for s in range(4):
            reqs = [(f"q{i}", 0, 4 * s, t) for i, t in enumerate(tags)]
            pub.publish(*step_message(s, reqs))
        wait_sent(pub, "fs-sink", 4)
        wait_sent(pub, "live", 4)
        live_ids = []
        while len(live_ids) < 4 * 4:
            b = live.recv(timeout=10)
            assert b is not None, "the live subscriber got too little"
            if isinstance(b, Batch):
                live_ids += b.header.rows.row_request_ids()
        live.close()
    finally:
        pub.close()
    assert wait_exit(proc, out) == 0, log_of(out)
    ds = TokenDataset(out, 0, batch_tokens=1000, shuffle_buffer=0, match=match)
    stored_ids = [r for batch in ds for r in batch["request_id"]]
    assert sorted(stored_ids) == sorted(live_ids) == ["q0"] * 16
    everything = [r for b in TokenDataset(out, 0, batch_tokens=1000) for r in b["request_id"]]
    assert len(everything) == 48
    with pytest.raises(ValueError, match="match: tags"):
        TokenDataset(out, 0, match={"split": {"nested": 1}})
