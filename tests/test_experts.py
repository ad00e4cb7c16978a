"""Expert load from router rows (``actbus.experts``), as stats and the dashboards count it,
and router rows in the fs sink: exact, bounded, and every bad row counted."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from actbus.bus import Batch
from actbus.experts import MAX_EXPERTS, MAX_LAYERS, ExpertLoad, router_info
from actbus.wire import Header, RowIndex
from consumers.fs import ActivationRun, FsSink, WriterConfig, parse_reduction
from consumers.fs.reader import split_router_rows
from consumers.wandb_dash import HISTOGRAM_BINS, flatten_experts

E, K = 8, 2


def router_rows(n: int, seed: int, experts: int = E, k: int = K) -> torch.Tensor:
    """``[n, 2k]`` rows as the engine publishes them: distinct ids, weights in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).float()
    return torch.cat([ids, torch.rand(n, k, generator=g)], 1)


def expected(rows: np.ndarray, experts: int = E) -> tuple[list[int], list[float]]:
    """Each expert's tokens and weight sum, counted one choice at a time."""
    k = rows.shape[1] // 2
    counts, weights = [0] * experts, [0.0] * experts
    for r in rows:
        for j in range(k):
            counts[int(r[j])] += 1
            weights[int(r[j])] += float(r[k + j])
    return counts, weights


def test_expert_load_counts_every_choice_per_layer():
    load = ExpertLoad.from_welcome({"router": {"num_experts": E, "top_k": K}})
    a, b, c = router_rows(5, 0), router_rows(7, 1), router_rows(4, 2)
    load.add(3, a)
    load.add(3, b.numpy())
    load.add(1, c)
    snap = json.loads(json.dumps(load.snapshot()))  # JSON-able as the dashboards send it
    assert list(snap["layers"]) == ["1", "3"] and snap["bad_rows"] == 0
    for layer, rows in (("3", torch.cat([a, b])), ("1", c)):
        counts, weights = expected(rows.numpy())
        got = snap["layers"][layer]
        assert got["tokens"] == len(rows) and got["counts"] == counts
        assert got["weights"] == pytest.approx(weights, rel=1e-12)
        assert got["imbalance"] == pytest.approx(max(counts) / (sum(counts) / E))


@pytest.mark.parametrize(
    "bad",
    [
        [1.5, 2.0, 0.5, 0.5],  # an id that is no integer
        [8.0, 2.0, 0.5, 0.5],  # past num_experts
        [-1.0, 2.0, 0.5, 0.5],  # negative
        [float("nan"), 2.0, 0.5, 0.5],
        [1.0, 2.0, float("inf"), 0.5],  # a weight that is not finite
        [1e30, 2.0, 0.5, 0.5],  # would overflow an int cast
    ],
)
def test_a_row_that_is_not_a_router_choice_is_counted_and_kept_out(bad):
    load = ExpertLoad(E, K)
    good = router_rows(3, 4)
    rows = torch.cat([good[:1], torch.tensor([bad]), good[1:]])
    assert load.add(0, rows) == 1
    got = load.snapshot()["layers"]["0"]
    counts, _ = expected(good.numpy())
    assert got["counts"] == counts and got["tokens"] == 3 and got["bad_rows"] == 1
    assert load.bad_rows == 1


def test_rows_of_the_wrong_width_are_refused_whole():
    load = ExpertLoad(E, K)
    assert load.add(2, router_rows(4, 0, k=3)) == 4
    assert load.snapshot()["layers"]["2"]["tokens"] == 0 and load.bad_rows == 4


def test_memory_is_bounded_by_experts_and_layers():
    load = ExpertLoad(E, K)
    for layer in range(MAX_LAYERS + 3):
        load.add(layer, router_rows(2, layer))
    assert len(load.layers) == MAX_LAYERS and load.layers_overflow_rows == 6
    assert all(lay.counts.shape == (E,) for lay in load.layers.values())


@pytest.mark.parametrize(
    ("router", "field"),
    [
        ("8 experts", "'router'"),
        ({"num_experts": 0, "top_k": 1}, "router.num_experts"),
        ({"num_experts": MAX_EXPERTS + 1, "top_k": 1}, "router.num_experts"),
        ({"num_experts": True, "top_k": 1}, "router.num_experts"),
        ({"num_experts": 8.0, "top_k": 1}, "router.num_experts"),
        ({"num_experts": 8, "top_k": 9}, "router.top_k"),
        ({"num_experts": 8}, "router.top_k"),
    ],
)
def test_a_welcomes_router_is_checked_by_field(router, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        router_info({"router": router})


def test_a_dense_welcome_has_no_expert_load():
    assert ExpertLoad.from_welcome({"model": "m", "hidden_size": 8}) is None


def test_wandb_logs_each_layers_load_as_one_histogram_of_at_most_512_bins():
    load = ExpertLoad(1000, 2)
    rows = torch.tensor([[0.0, 999.0, 0.5, 0.5], [1.0, 2.0, 0.5, 0.5]])
    load.add(4, rows)
    row = flatten_experts(load.snapshot())
    counts, edges = row["experts/L4/load"]
    assert len(counts) <= HISTOGRAM_BINS and len(edges) == len(counts) + 1
    # Runs of 2 adjacent experts: {0, 1}, {2, 3}, ..., {998, 999}.
    assert len(counts) == 500 and edges[-1] == 1000
    assert counts.sum() == 4 and counts[:2].tolist() == [2, 1] and counts[-1] == 1
    assert row["experts/L4/tokens"] == 2
    import wandb

    wandb.Histogram(np_histogram=(counts, edges))  # W&B takes it as it is
    small = flatten_experts(ExpertLoad(E, K).snapshot() | {"layers": {}})
    assert small == {"experts/bad_rows": 0, "experts/missed": 0}
    assert flatten_experts({}) == {}


# ------------------------------------------------------------------ the fs sink

INFO = {
    "model": "m",
    "hidden_size": 16,
    "dtype": "bfloat16",
    "layers": [1],
    "hooks": ["router"],
    "router": {"num_experts": E, "top_k": K},
}


def _router_batch(step: int, rid: str, start: int, rows: torch.Tensor) -> Batch:
    n = len(rows)
    pos = np.arange(start, start + n)
    ri = RowIndex([rid], np.array([0, n]), pos, pos + 7)
    return Batch(Header(step, 1, "router", "float32", (n, 2 * K), "m", ri), rows, seq=step)


@pytest.mark.parametrize("reduce", ["none", "int8", "pca:2"])
def test_the_sink_stores_router_rows_as_published_whatever_the_reduction(tmp_path, reduce):
    """Router rows are ids and weights: stored bit for bit under any ``--reduce``
    (an int8 or PCA id is no id), read back as ints and weights, and by HF datasets."""
    cfg = WriterConfig(reduction=parse_reduction(reduce, warmup=4), shard_rows=4)
    sink = FsSink(tmp_path / "run", cfg)
    sink.on_welcome(INFO)
    a, b = router_rows(6, 0), router_rows(3, 1)
    sink.on_batch(_router_batch(0, "a", 0, a[:4]))
    sink.on_batch(_router_batch(0, "b", 0, b))
    sink.on_batch(_router_batch(1, "a", 4, a[4:]))
    sink.close()
    run = ActivationRun(tmp_path / "run")
    assert run.manifest["router"] == {"num_experts": E, "top_k": K}
    pos, ids, weights = run.router_rows("a", 1)
    assert pos.tolist() == list(range(6))
    assert ids.dtype == np.int64 and np.array_equal(ids, a[:, :K].numpy().astype(np.int64))
    assert weights.dtype == np.float32 and np.array_equal(weights, a[:, K:].numpy())
    # HF datasets reads the shards; the documented split gives the same rows.
    shards = [str(p) for p in run.shards(1, "router")]
    ds = datasets.load_dataset("arrow", data_files=shards, split="train", cache_dir=str(tmp_path))
    got = {(r["request_id"], r["position"]): np.asarray(r["activation"], np.float32) for r in ds}
    assert len(got) == 9
    for rid, rows in (("a", a), ("b", b)):
        for p, row in enumerate(rows.numpy()):
            assert np.array_equal(got[rid, p], row)
    h_ids, h_w = split_router_rows(
        np.stack([got["b", p] for p in range(3)]), run.manifest["router"]
    )
    assert np.array_equal(h_ids, b[:, :K].numpy()) and np.array_equal(h_w, b[:, K:].numpy())


def test_a_replayed_router_stream_is_the_published_one(tmp_path):
    """``actbus replay`` puts stored router rows back on the bus bit for bit, with the
    WELCOME's ``router`` entry, so the dashboards and ``actbus stats`` count them."""
    import threading

    from actbus.bus import Subscriber, Subscription
    from consumers.fs.replay import ReplayConfig, replay

    sink = FsSink(tmp_path / "run", WriterConfig(reduction=parse_reduction("int8")))
    sink.on_welcome(INFO)
    a = router_rows(5, 3)
    sink.on_batch(_router_batch(0, "a", 0, a[:2]))
    sink.on_batch(_router_batch(1, "a", 2, a[2:]))
    sink.close()
    address = f"ipc://{tmp_path}/replay.sock"
    done: dict = {}
    t = threading.Thread(
        target=lambda: done.update(replay(ReplayConfig(tmp_path / "run", address, wait_s=30))),
        daemon=True,
    )
    t.start()
    with Subscriber(address, Subscription(hooks=("router",), name="check")) as sub:
        welcome = sub.wait_welcome(30)
        got = list(sub)  # until the replay's END
    t.join(timeout=30)
    assert done and welcome["router"] == {"num_experts": E, "top_k": K}
    assert [b.header.hook for b in got] == ["router", "router"]
    assert torch.equal(torch.cat([b.tensor for b in got]), a)
    load = ExpertLoad.from_welcome(welcome)
    for b in got:
        load.add(b.header.layer, b.tensor)
    assert load.snapshot()["layers"]["1"]["counts"] == expected(a.numpy())[0]


def test_stored_rows_that_are_no_router_choice_are_refused_on_read():
    with pytest.raises(ValueError, match="outside"):
        split_router_rows(np.array([[8.0, 1.0, 0.5, 0.5]]), {"num_experts": E, "top_k": K})
    with pytest.raises(ValueError, match="not an integer"):
        split_router_rows(np.array([[0.5, 1.0, 0.5, 0.5]]))
    with pytest.raises(ValueError, match="2 \\* top_k"):
        split_router_rows(np.zeros((1, 6)), {"num_experts": E, "top_k": K})
