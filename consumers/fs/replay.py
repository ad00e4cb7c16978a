"""``actbus replay RUN_DIR --publish ADDR``: a stored run back on the bus.

Rows are grouped by (step, layer, hook) as they were captured, each group becomes
one message with its original header (step, layer, hook, and a row index of
request ids, sample indices, positions, token ids and tags), published in step
order through an ordinary ``Publisher``. A run stored from several publishers (the
server restarted under a running sink) holds several streams, each numbering its
steps from 0: they are replayed one after the other, never merged, the later
ones' steps offset to follow the earlier ones'. Any consumer (a trainer, a dashboard,
another sink) then runs from stored data through the same path as from an engine.

What cannot be replayed as captured: a lossy reduction is published decoded
(``int8``/``pca``/``topk`` as float32 ``[hidden]``, ``proj:K`` as float32 ``[K]``),
and request ends are not stored by the sink, so headers carry none. Rows within a
message are in stored order, grouped by request. Uncompressed shards are memory
mapped; a compressed shard is held decompressed while its rows are replayed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actbus.bus import Publisher
from actbus.bus.addresses import check_address
from actbus.flags import HelpFormatter, int_list, str_list
from actbus.wire import DTYPE_NAMES, Header, RowIndex
from consumers.fs.reader import ActivationRun, BadShard

log = logging.getLogger("actbus.replay")


@dataclass(frozen=True)
class ReplayConfig:
    run: Path
    address: str
    rate: float | None = None
    """Steps per second; None: as fast as the subscribers take them."""
    wait_subscribers: int = 1
    wait_s: float = 60.0
    drain_s: float = 600.0
    """Longest wait, at the end, for subscribers to acknowledge everything."""
    layers: tuple[int, ...] | None = None
    hooks: tuple[str, ...] | None = None
    skip_bad: bool = False
    """Leave out shards that fail the check on open (warned), instead of stopping."""

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be above 0 steps/s, got {self.rate}")
        if self.wait_subscribers < 0:
            raise ValueError(f"--wait-subscribers must be >= 0, got {self.wait_subscribers}")


def _step_offsets(entries: list[dict[str, Any]]) -> dict[int, int]:
    """Per stream (a publisher's run), what is added to its steps so that each stream's
    steps follow the previous one's: streams stay apart and steps keep increasing."""
    last: dict[int, int] = {}
    for e in entries:
        stream = int(e.get("stream", 0))
        last[stream] = max(last.get(stream, -1), int(e["steps"][1]))
    offsets, base = {}, 0
    for stream in sorted(last):
        offsets[stream] = base
        base += last[stream] + 1
    return offsets


def _index(
    run: ActivationRun, layers: tuple[int, ...] | None, hooks: tuple[str, ...] | None
) -> tuple[pa.Table, list[dict[str, Any]]]:
    """``step, layer, hook, shard, row`` of every stored row, in replay order; ``step``
    is offset per stream (``_step_offsets``)."""
    parts = []
    entries = [
        e
        for e in run.shard_entries()
        if (layers is None or e["layer"] in layers) and (hooks is None or e["hook"] in hooks)
    ]
    offsets = _step_offsets(entries)
    for i, e in enumerate(entries):
        t = run.read(run.path / e["path"])
        step = pc.add(t.column("step"), pa.scalar(offsets[int(e.get("stream", 0))], pa.int64()))
        parts.append(
            pa.table(
                {
                    "step": step,
                    "layer": t.column("layer"),
                    "hook": t.column("hook"),
                    "shard": pa.array(np.full(t.num_rows, i, dtype=np.int32)),
                    "row": pa.array(np.arange(t.num_rows, dtype=np.int64)),
                }
            )
        )
    if not parts:
        raise ValueError(
            f"{run.path}: no committed shards to replay for --layers {layers} --hooks {hooks}; "
            f"the run has streams {sorted(run.manifest.get('rows', {}))}"
        )
    table = pa.concat_tables(parts)
    order = pc.sort_indices(
        table,
        sort_keys=[
            ("step", "ascending"),
            ("layer", "ascending"),
            ("hook", "ascending"),
            ("shard", "ascending"),
            ("row", "ascending"),
        ],
    )
    return table.take(order), entries


def _message(run: ActivationRun, rows: pa.Table, step: int) -> tuple[Header, Any]:
    """One (step, layer, hook) group's header (published as ``step``) and decoded tensor."""
    ri_req: list[str] = []
    ri_si: list[int] = []
    ri_tags: list[dict] = []
    # group rows by request, in order of first appearance (a RowIndex needs it)
    ids = rows.column("request_id").to_pylist()
    sidx = rows.column("sample_index").to_pylist()
    tags = rows.column("tags").to_pylist()
    order: dict[tuple[str, int], list[int]] = {}
    for i, key in enumerate(zip(ids, sidx, strict=True)):
        if key not in order:
            order[key] = []
            ri_req.append(key[0])
            ri_si.append(key[1])
            ri_tags.append(json.loads(tags[i]) if tags[i] else {})
        order[key].append(i)
    perm = np.concatenate([np.array(v, dtype=np.int64) for v in order.values()])
    if not np.array_equal(perm, np.arange(len(perm))):
        rows = rows.take(perm)
    counts = [len(v) for v in order.values()]
    t = run.decode(rows).contiguous()
    index = RowIndex(
        request_ids=ri_req,
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        positions=rows.column("position").to_numpy().astype(np.int64),
        token_ids=rows.column("token_id").to_numpy().astype(np.int64),
        sample_index=ri_si if any(ri_si) else [],
        tags=ri_tags if any(ri_tags) else [],
    )
    first = rows.slice(0, 1)
    header = Header(
        step=step,
        layer=int(first.column("layer")[0].as_py()),
        hook=str(first.column("hook")[0].as_py()),
        dtype=DTYPE_NAMES[t.dtype],
        shape=tuple(t.shape),
        model=str(run.manifest.get("model") or ""),
        rows=index,
    )
    return header, t


def replay(cfg: ReplayConfig) -> dict[str, Any]:
    """Publish the run; returns counts (steps, messages, rows, seconds, publisher stats)."""
    run = ActivationRun(cfg.run, skip_bad=cfg.skip_bad)
    index, entries = _index(run, cfg.layers, cfg.hooks)
    sample = run.read(run.path / entries[0]["path"]).slice(0, 1)
    dtype = DTYPE_NAMES[run.decode(sample).dtype]
    info = {
        "model": run.manifest.get("model"),
        "hidden_size": run.width,
        "dtype": dtype,
        "layers": sorted({e["layer"] for e in entries}),
        "hooks": sorted({e["hook"] for e in entries}),
        "replay_of": str(run.path),
        # A stored router stream replays with its WELCOME entry: expert load is shown.
        **({"router": run.manifest["router"]} if run.manifest.get("router") else {}),
    }
    pub = Publisher(cfg.address, info=info, heartbeat_s=0.2)
    out = {"steps": 0, "messages": 0, "rows": 0}
    try:
        deadline = time.monotonic() + cfg.wait_s
        while len(pub.stats()["subscribers"]) < cfg.wait_subscribers:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"--wait-subscribers {cfg.wait_subscribers}: only "
                    f"{len(pub.stats()['subscribers'])} subscribed to {cfg.address} within "
                    f"{cfg.wait_s}s (--wait-s)"
                )
            time.sleep(0.05)
        t0 = time.monotonic()
        tables: dict[int, pa.Table] = {}
        keys = np.stack(
            [
                index.column("step").to_numpy(),
                index.column("layer").to_numpy(),
                pc.dictionary_encode(index.column("hook")).combine_chunks().indices.to_numpy(),
            ]
        )
        change = np.flatnonzero(np.any(keys[:, 1:] != keys[:, :-1], axis=0)) + 1
        bounds = [0, *change.tolist(), index.num_rows]
        shard_col = index.column("shard").to_numpy()
        row_col = index.column("row").to_numpy()
        last_step = None
        for a, b in itertools.pairwise(bounds):
            step = int(keys[0, a])
            if step != last_step:
                if cfg.rate is not None and last_step is not None:
                    wait = t0 + out["steps"] / cfg.rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                out["steps"] += 1
                last_step = step
            pieces = []
            for s in np.unique(shard_col[a:b]):
                if int(s) not in tables:
                    tables.clear()  # one shard at a time; shards are read in step order
                    tables[int(s)] = run.read(run.path / entries[int(s)]["path"])
                sel = row_col[a:b][shard_col[a:b] == s]
                pieces.append(tables[int(s)].take(pa.array(sel)))
            rows = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
            header, tensor = _message(run, rows, step)
            pub.publish(header, tensor)
            out["messages"] += 1
            out["rows"] += rows.num_rows
    except BaseException:
        pub.close(timeout=10.0)
        raise
    pub.close(timeout=cfg.drain_s)  # waits for every subscriber's acknowledgement
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["publisher"] = {k: v for k, v in pub.stats().items() if k != "latency"}
    return out


def main(argv: list[str]) -> int:
    """publish a stored run (fs-sink) back on the bus"""
    p = argparse.ArgumentParser(
        prog="actbus replay",
        description="Publish a run the fs sink stored back on the bus, step by step, "
        "through an ordinary publisher: any consumer runs from it as from an engine.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("run", help="run directory written by fs-sink")
    p.add_argument("--publish", required=True, help="address to publish on, e.g. ipc:///tmp/r")
    p.add_argument("--rate", type=float, default=None, help="steps/s (default: as fast as taken)")
    p.add_argument(
        "--wait-subscribers", type=int, default=1, help="subscribers to wait for before step 0"
    )
    p.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for them")
    p.add_argument("--layers", type=int_list, default=None, help="replay only these layers: 0,3")
    p.add_argument("--hooks", type=str_list, default=None, help="replay only these hooks")
    p.add_argument(
        "--skip-bad-shards",
        action="store_true",
        help="leave out shards that are truncated or missing (warned) instead of stopping",
    )
    p.add_argument("--log-level", default="INFO", help="logging level")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        check_address(args.publish, field_name="--publish")  # named by its flag
        cfg = ReplayConfig(
            Path(args.run),
            args.publish,
            rate=args.rate,
            wait_subscribers=args.wait_subscribers,
            wait_s=args.wait_s,
            layers=tuple(args.layers) if args.layers else None,
            hooks=tuple(args.hooks) if args.hooks else None,
            skip_bad=args.skip_bad_shards,
        )
        out = replay(cfg)
    except (ValueError, FileNotFoundError, TimeoutError, OSError, BadShard) as e:
        print(f"actbus replay: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0
