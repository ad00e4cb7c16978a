"""The trainers' data path on its own: a slow trainer under drop_oldest loses whole
messages at the publisher, every one counted; what arrives is trained on exactly once."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from tests.support.trainer_synth import SynthPublisher
from trainers.buffer import ShuffleBuffer, TrainingRows
from trainers.config import DataConfig
from trainers.data import ActivationDataModule, TokenHub, TokenStream


def test_slow_trainer_drops_oldest_and_counts_every_drop(tmp_path):
    address = f"ipc://{tmp_path}/synth.sock"
    messages = 200
    pub = SynthPublisher(address, messages, "--rows", "256")
    cfg = DataConfig(
        streams=((0, "post_block"),),
        address=address,
        policy="drop_oldest",
        window=2,
        batch_tokens=256,
        buffer_tokens=512,
        warmup_tokens=256,
        idle_s=5,
    )
    stream = TokenStream(cfg)
    seen: Counter = Counter()
    try:
        for batch in stream:
            b = batch["L0.post_block"]
            seen.update(zip(b["request_id"], b["position"].tolist(), strict=True))
            time.sleep(0.05)  # a trainer slower than the publisher
    finally:
        stream.close()
        pub.stop()
    s = stream.stats()
    print(f"\n{s}")
    assert s["bus/missed"] > 0  # it fell behind, and knows by how much
    assert s["bus/received"] + s["bus/missed"] <= messages
    assert s["bus/publisher_dropped"] > 0  # the publisher's own count, from heartbeats
    assert s["bus/received"] >= 4
    # Whatever arrived was trained on, each token once.
    assert max(seen.values()) == 1
    assert len(seen) == s["bus/received"] * 256 == s["tokens/L0.post_block"]


def test_data_module_stop_ends_a_live_stream_and_its_source_thread(tmp_path):
    """``stop()`` (what Ctrl-C calls) ends the batches while the publisher still has
    data: the first after what the buffers held (so it is trained on and saved), a
    second at once; teardown then finds the subscriber's thread ended. A data module
    stopped before its stream exists starts it stopped."""
    address = f"ipc://{tmp_path}/synth.sock"
    pub = SynthPublisher(address, 100_000, "--rows", "64")  # far more than is read here
    cfg = DataConfig(
        streams=((0, "post_block"),),
        address=address,
        batch_tokens=64,
        buffer_tokens=256,
        warmup_tokens=64,
    )
    try:
        dm = ActivationDataModule(cfg)
        batches = iter(dm.train_dataloader())
        assert len(next(batches)["L0.post_block"]["request_id"]) == 64
        time.sleep(1.0)  # the buffer fills
        assert dm.stop()
        t0 = time.monotonic()
        rest = sum(1 for _ in batches)
        held = cfg.buffer_tokens // cfg.batch_tokens + cfg.prefetch + 3  # + in hand
        assert time.monotonic() - t0 < 5 and 1 <= rest <= held
        dm.teardown("fit")
        assert not dm.stream.source.is_alive() and dm.stream.hub.finished
        assert dm.stats()["bus/received"] >= 1

        now = ActivationDataModule(cfg)
        batches = iter(now.train_dataloader())
        next(batches)
        time.sleep(1.0)
        assert now.stop() and not now.stop()  # Ctrl-C twice: now
        t0 = time.monotonic()
        rest = sum(1 for _ in batches)
        assert time.monotonic() - t0 < 5 and rest <= cfg.prefetch + 1
        now.teardown("fit")

        early = ActivationDataModule(cfg)
        early.stop()
        assert list(early.train_dataloader()) == []
        early.stream.source.join(timeout=5)  # it ends on its own, not only at teardown
        assert not early.stream.source.is_alive() and early.stream.hub.finished
        early.teardown("fit")
    finally:
        pub.stop()


def test_shuffle_buffer_hands_each_row_out_once_in_mixed_order():
    buf = ShuffleBuffer(1000, 2, torch.float32, 0, seed=0)
    n = 1000
    rows = TrainingRows(
        torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 2),
        torch.arange(n),
        torch.arange(n).numpy().astype(object),
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, 0),
    )
    assert buf.put(rows) == n and buf.room == 0
    out = []
    while buf.n:
        got = buf.take(128)
        assert torch.equal(got.activation[:, 0].long(), got.position)  # rows stay whole
        out += got.position.tolist()
    assert sorted(out) == list(range(n))
    assert out[:128] != sorted(out[:128])  # shuffled


def test_data_config_errors_name_the_field():
    with pytest.raises(ValueError, match="exactly one source"):
        DataConfig(streams=((0, "post_block"),))
    with pytest.raises(ValueError, match="buffer_tokens"):
        DataConfig(streams=((0, "post_block"),), address="ipc:///x", batch_tokens=512,
                   buffer_tokens=600)  # fmt: skip


def _rows(n: int, start: int = 0) -> TrainingRows:
    return TrainingRows(
        torch.randn(n, 8),
        torch.arange(start, start + n),
        np.array([f"r{i}" for i in range(start, start + n)], dtype=object),
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, 0),
    )


@pytest.mark.parametrize(
    ("total", "sizes"),
    [
        (302, [100, 100, 102]),  # 2 left over: they go with the last batch
        (340, [100, 100, 140]),
        (360, [100, 100, 100, 60]),  # 60 is over half a batch: a batch of its own
        (300, [100, 100, 100]),
        (40, [40]),  # a drain of under half a batch in all is one small batch
    ],
)
def test_a_drain_leaves_no_batch_of_a_few_rows(total, sizes):
    """Once the source has finished, a stream's last rows join the batch before them
    when fewer than half a batch would be left; every row is handed out once."""
    cfg = DataConfig(
        streams=((0, "post_block"),), address="ipc:///x", batch_tokens=100,
        buffer_tokens=1000, warmup_tokens=0,
    )  # fmt: skip
    hub, stop = TokenHub(cfg), threading.Event()
    (key,) = hub.keys
    hub.put(key, _rows(total), stop)
    hub.finish()
    got, seen = [], []
    while (b := hub.next_batch(stop)) is not None:
        got.append(len(b[key]["position"]))
        seen += b[key]["position"].tolist()
    assert got == sizes
    assert sorted(seen) == list(range(total))


def test_warm_up_is_reported_until_the_first_step(monkeypatch, caplog):
    """Issue 50: the warm-up's lines stopped once its tokens were in, though the first
    step waits for the batch Lightning reads ahead of it: a trainer looked hung for as
    long as that batch took. They go on, saying what the first step waits for, until
    the trainer starts it."""
    import trainers.data as data

    monkeypatch.setattr(data, "WARMUP_LOG_S", 0.0)  # a line each time the hub waits
    caplog.set_level("INFO", logger="actbus.trainers")
    cfg = DataConfig(
        streams=((0, "post_block"),), address="ipc:///x", batch_tokens=100,
        buffer_tokens=1000, warmup_tokens=100,
    )  # fmt: skip
    hub, stop = TokenHub(cfg), threading.Event()
    (key,) = hub.keys
    hub.put(key, _rows(100), stop)
    assert len(hub.next_batch(stop)[key]["position"]) == 100  # the warm-up's batch

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "warming up" in r.getMessage()]

    caplog.clear()
    waiting = threading.Thread(target=hub.next_batch, args=(stop,), daemon=True)
    waiting.start()  # the batch read ahead of the first step: none yet
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not lines():
        time.sleep(0.05)
    assert lines(), "no warm-up line while the first step waited"
    assert "the warm-up's 100 tokens per stream are in; the first step waits" in lines()[0]
    assert "L0.post_block 0 of the 100 tokens per stream (--batch-tokens)" in lines()[0]
    hub.first_step()
    assert any(r.getMessage() == "warmed up: the first step starts" for r in caplog.records)
    time.sleep(0.6)  # two of the hub's waits: no line after the first step
    caplog.clear()
    time.sleep(0.6)
    assert not lines(), lines()
    stop.set()
    hub.finish()
    waiting.join(timeout=10)
    assert not waiting.is_alive()
