"""Training data from the live bus or from a stored run, through one DataModule.

A source thread (``BusSource``: a subscriber; ``RunSource``: a run the sink wrote)
puts rows into a ``TokenHub``: one shuffle buffer per (layer, hook) stream. The
trainer's ``TokenStream`` takes batches out: the first after a warm-up, then one
whenever every stream has a batch's worth. A batch is ``{point_key: {"activation",
"position", "request_id", "split", "label"}}`` (see ``TrainingRows``), so several
SAEs or probes on different layers train from one subscription.

Nothing is lost silently: the publisher's drops for this subscriber (its
``drop_oldest`` policy when the trainer is slower than the engine) come back as
``missed`` and the heartbeat's view, rows the hub itself had to let go (one
stream's buffer full while another starves) are counted as ``overflow``, and
rows holding a NaN, an infinity or a value beyond ``ROW_LIMIT`` (float32 training
would overflow on it), never trained on, as ``nonfinite``, and rows of another width
than the stream's first (a publisher that changed model, or lies) as ``width_refused``.

With several ranks (DDP) each rank subscribes on its own, in one load-balancing
group, so each message (and so each token) goes to exactly one rank; a rank whose
stream ended yields empty batches until every rank has ended (the trainer stops
them together), so no rank waits forever in a collective.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from actbus.streams import point_key
from trainers.buffer import ShuffleBuffer, TrainingRows, parse_labels, split_value
from trainers.config import DataConfig

log = logging.getLogger("actbus.trainers")
WARMUP_LOG_S = 5.0
"""While warming up, a line every this many seconds says how far each stream is."""
AUTO_STEPS = 200
"""--from without --epochs: passes enough for about this many steps..."""
MAX_AUTO_EPOCHS = 1000
"""...but at most this many passes."""
ROW_LIMIT = 2.0**32
"""Rows with a value beyond +-this are left out like NaN rows: squared and summed over a
batch in float32 (an SAE's scale, a probe's standardisation) they would overflow to
inf and leave NaN weights. No model's stream comes near (massive activations: ~1e4)."""


def auto_epochs(rows: int, batch_tokens: int, world_size: int = 1) -> int:
    """Passes over ``rows`` stored rows that make about ``AUTO_STEPS`` steps of
    ``batch_tokens`` on each of ``world_size`` ranks (1 to ``MAX_AUTO_EPOCHS``)."""
    per_pass = max(rows // max(world_size, 1), 1) / batch_tokens
    return max(1, min(MAX_AUTO_EPOCHS, math.ceil(AUTO_STEPS / per_pass)))


try:  # Lightning is optional for the benchmark, which uses TokenHub/BusSource alone.
    from lightning.pytorch import LightningDataModule
except ImportError:  # pragma: no cover
    LightningDataModule = object  # type: ignore[misc,assignment]


class TokenHub:
    """Per-stream shuffle buffers shared by one source thread and the trainer."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.keys = [point_key(layer, hook) for layer, hook in cfg.streams]
        self._buffers: dict[str, ShuffleBuffer] = {}
        self._cond = threading.Condition()
        self._finished = False
        self._warm = cfg.warmup_tokens == 0
        self.error: BaseException | None = None
        self.counters: dict[str, float] = {"messages": 0, "rows_in": 0}
        self.overflow: dict[str, int] = dict.fromkeys(self.keys, 0)
        self.nonfinite: dict[str, int] = dict.fromkeys(self.keys, 0)
        """Rows with a NaN, an infinity or a value beyond ``ROW_LIMIT``: counted, left out
        (not in ``rows_in``)."""
        self.width_refused: dict[str, int] = dict.fromkeys(self.keys, 0)
        """Rows whose width is not the stream's (its first rows'): counted, left out."""
        self.handed_out: dict[str, int] = dict.fromkeys(self.keys, 0)
        self.first_data_at: float | None = None
        self.max_position = -1
        """The highest token position that arrived (the longest sequence, for checkpoints)."""
        self._progress_at = time.monotonic()
        self.stepped = threading.Event()
        """Set when the trainer starts its first step (``first_step``): until then the
        warm-up is reported, however many batches Lightning and the prefetch took."""

    # -------------------------------------------------------------- source side
    def put(self, key: str, rows: TrainingRows, stop: threading.Event) -> None:
        """Add rows; waits while the buffer is full and the trainer can make progress.
        Rows holding a NaN, an infinity or a value beyond ``ROW_LIMIT``, and rows of
        another width than the stream's, are counted and left out."""
        if key not in self.keys:
            return
        with self._cond:
            buf = self._buffers.get(key)
            width = int(rows.activation.shape[1]) if rows.activation.dim() == 2 else -1
            if width < 0 or (buf is not None and width != buf.x.shape[1]):
                first = self.width_refused[key] == 0
                self.width_refused[key] += len(rows)
                if first:
                    log.warning(
                        "%s: refused %d rows of shape %s: the stream's rows are %d wide (its "
                        "first rows'); a publisher changed model? Counted as width_refused/%s; "
                        "not logged again",
                        key, len(rows), tuple(rows.activation.shape),
                        buf.x.shape[1] if buf is not None else -1, key,
                    )  # fmt: skip
                return
        keep = finite_rows(rows.activation)
        if keep is not None:
            bad = int((~keep).sum())
            with self._cond:
                first = self.nonfinite[key] == 0
                self.nonfinite[key] += bad
            if first:
                log.warning(
                    "%s: rows with a NaN, an infinity or a value beyond +-%.3g are left out "
                    "of training (counted as nonfinite/%s; not logged again)",
                    key,
                    ROW_LIMIT,
                    key,
                )
            rows = rows.take(keep.nonzero().squeeze(1))
            if not len(rows):
                return
        with self._cond:
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = ShuffleBuffer(
                    self.cfg.buffer_tokens,
                    rows.activation.shape[1],
                    rows.activation.dtype,
                    rows.label.shape[1],
                    seed=self.cfg.seed + len(self._buffers),
                )
            if self.first_data_at is None:
                self.first_data_at = time.monotonic()
            self.counters["messages"] += 1
            self.counters["rows_in"] += len(rows)
            if len(rows):
                self.max_position = max(self.max_position, int(rows.position.max()))
            done = 0
            while done < len(rows):
                done += buf.put(rows.slice(done, len(rows)))
                self._cond.notify_all()
                if done == len(rows) or stop.is_set():
                    break
                if self._can_progress():
                    self._cond.wait(timeout=0.25)
                else:  # another stream starves: waiting here would wait forever
                    self.overflow[key] += len(rows) - done
                    break

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._finished = True
            self.error = self.error or error
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        return self._finished

    def _filled(self, key: str) -> int:
        buf = self._buffers.get(key)
        return buf.n if buf is not None else 0

    def _can_progress(self) -> bool:
        need = self.cfg.batch_tokens if self._warm else self.cfg.warmup_tokens
        return all(self._filled(k) >= max(need, 1) for k in self.keys)

    # ------------------------------------------------------------- trainer side
    def next_batch(self, stop: threading.Event) -> dict[str, dict[str, Any]] | None:
        """The next batch, or None once the source finished and the buffers are empty."""
        cfg = self.cfg
        with self._cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"trainer data source failed: {self.error}") from self.error
                if self._max_reached():
                    return None
                draining = self._finished or stop.is_set()
                if self._can_progress():
                    self._warm = True
                    sizes = {k: self._batch_size(k, draining) for k in self.keys}
                    break
                if draining:
                    if not any(self._filled(k) for k in self.keys):
                        return None
                    sizes = {k: self._batch_size(k, draining) for k in self.keys}
                    break
                if not self.stepped.is_set():
                    # Warm or not: the first step also waits for the batches read ahead
                    # of it (Lightning reads one more before it steps on the first).
                    self._log_warmup()
                self._cond.wait(timeout=0.25)
            out = {}
            for k, n in sizes.items():
                if cfg.max_tokens is not None:
                    n = min(n, cfg.max_tokens - self.handed_out[k])
                rows = self._buffers[k].take(max(n, 0)) if k in self._buffers else None
                self.handed_out[k] += len(rows) if rows is not None else 0
                out[k] = rows
            self._cond.notify_all()
        d = next((r.activation.shape[1] for r in out.values() if r is not None), 0)
        return {k: (r if r is not None else _empty(d)).as_batch() for k, r in out.items()}

    def _batch_size(self, key: str, draining: bool) -> int:
        """``batch_tokens``, or while draining (the source finished or the trainer
        stops) a stream's last rows with the batch before them when fewer than half a
        batch would be left: an optimizer step on a few rows is a full step on noise.
        Only a drain that holds under half a batch in all makes a batch that small."""
        b, have = self.cfg.batch_tokens, self._filled(key)
        if draining and have < b + b // 2:
            return have
        return min(b, have)

    def _log_warmup(self) -> None:
        """Every ``WARMUP_LOG_S`` until the first step: how many tokens each stream has
        of the warm-up, then of the batch the first step still waits for."""
        now = time.monotonic()
        if now - self._progress_at < WARMUP_LOG_S:
            return
        self._progress_at = now
        have = ", ".join(f"{k} {self._filled(k):,}" for k in self.keys)
        if self._warm:
            log.info(
                "warming up: the warm-up's %s tokens per stream are in; the first step waits "
                "for one more batch (read ahead of it): %s of the %s tokens per stream "
                "(--batch-tokens)",
                f"{self.cfg.warmup_tokens:,}",
                have,
                f"{self.cfg.batch_tokens:,}",
            )
            return
        log.info(
            "warming up: %s of the %s tokens per stream the first step waits for "
            "(--warmup-tokens)%s",
            have,
            f"{self.cfg.warmup_tokens:,}",
            "" if self.first_data_at is not None else "; nothing has arrived yet",
        )

    def first_step(self) -> None:
        """The trainer starts its first step: the warm-up is over (said once)."""
        if not self.stepped.is_set():
            self.stepped.set()
            log.info("warmed up: the first step starts")

    def _max_reached(self) -> bool:
        m = self.cfg.max_tokens
        return m is not None and all(self.handed_out[k] >= m for k in self.keys)

    def stats(self) -> dict[str, float]:
        with self._cond:
            out: dict[str, float] = dict(self.counters)
            for k in self.keys:
                out[f"buffer/{k}"] = self._filled(k)
                out[f"overflow/{k}"] = self.overflow[k]
                out[f"nonfinite/{k}"] = self.nonfinite[k]
                out[f"width_refused/{k}"] = self.width_refused[k]
                out[f"tokens/{k}"] = self.handed_out[k]
            return out


def bus_drops(stats: dict[str, float]) -> tuple[int, int]:
    """(messages the publisher dropped for this trainer, messages it had for it in all)
    from a source's ``stats``: the publisher's counts, or what was seen here (received,
    and the gaps between) if more: its counts come with heartbeats, and can lag one."""
    missed = stats.get("bus/missed", 0)
    dropped = max(stats.get("bus/publisher_dropped", 0), missed)
    routed = max(stats.get("bus/routed", 0), stats.get("bus/received", 0) + missed)
    return int(dropped), int(routed)


def finite_rows(x: torch.Tensor) -> torch.Tensor | None:
    """None when every row of ``x`` is finite and within +-``ROW_LIMIT``, else which
    rows are (a bool mask).

    Two cheap passes (each row's largest and smallest value: NaN propagates through
    both, an infinity is beyond the limit), exact whatever a row's sum would be (a full
    ``isfinite`` pass cost 50x a sum on bf16)."""
    if not x.numel():
        return None
    # In float32: the limit is beyond float16's range (it would round to inf there).
    ok = (x.amax(1).float() <= ROW_LIMIT) & (x.amin(1).float() >= -ROW_LIMIT)
    return None if bool(ok.all()) else ok


def _empty(d: int) -> TrainingRows:
    return TrainingRows(
        torch.zeros(0, d),
        torch.zeros(0, dtype=torch.long),
        np.empty(0, dtype=object),
        torch.zeros(0, dtype=torch.float64),
        torch.zeros(0, 0),
    )


class BusSource(threading.Thread):
    """A subscriber on a thread of its own, feeding a hub until the stream ends."""

    def __init__(self, cfg: DataConfig, hub: TokenHub, group: str = "") -> None:
        super().__init__(name="actbus-trainer-bus", daemon=True)
        self.cfg = cfg
        self.hub = hub
        self.group = group
        self.stop_event = threading.Event()
        self.stats: dict[str, Any] = {"bad_label_rows": 0} if cfg.label_tags else {}
        self.welcomed = threading.Event()
        self.info: dict[str, Any] = {}
        """The publisher's WELCOME (model, hidden_size, layers, ...)."""
        self._pub_noted = 0.0

    def subscription(self):
        from actbus.bus import Subscription
        from actbus.bus.protocol import parse_policy

        cfg = self.cfg
        return Subscription(
            **parse_policy(cfg.policy),
            window=cfg.window,
            window_bytes=int(cfg.window_mb * (1 << 20)),
            layers=tuple(sorted({layer for layer, _ in cfg.streams})),
            hooks=tuple(sorted({hook for _, hook in cfg.streams})),
            match=cfg.match,
            group=self.group,
            name=cfg.name,
        )

    def run(self) -> None:
        from actbus.bus import Batch
        from actbus.bus.fanin import subscribe

        cfg = self.cfg
        error: BaseException | None = None
        sub = None
        try:
            sub = subscribe(
                cfg.address,
                self.subscription(),
                server_key=cfg.server_key,
                client_secret_key=cfg.client_secret_key,
            )
            last = time.monotonic()
            while not self.stop_event.is_set():
                out = sub.recv(timeout=0.25)
                now = time.monotonic()
                if out is None:
                    if cfg.idle_s is not None and now - last > cfg.idle_s:
                        log.info("no data for %.1fs: ending the stream", cfg.idle_s)
                        break
                    continue
                if isinstance(out, Batch):
                    last = now
                    self._put(out)
                elif out.kind == "welcome":
                    self.info = dict(out.body)
                    self.welcomed.set()
                elif out.kind == "end":
                    log.info("the publisher ended the stream")
                    break
                self._note(sub)
        except BaseException as e:  # reported to the trainer, which raises it
            error = e
        finally:
            if sub is not None:
                self._pub_noted = 0.0  # the final counters, each publisher's included
                self._note(sub)
                sub.close()
            _report_bad_labels(self.stats)
            self.hub.finish(error)

    def _put(self, batch) -> None:
        h = batch.header
        ri = h.rows
        tags = ri.tags or [{}] * len(ri.request_ids)
        labels, bad = parse_labels(tags, self.cfg.label_tags)
        # Queued for the training loop: never a view of the shared memory (``keep``).
        rows = TrainingRows.from_message(batch.keep(), ri, labels)
        if bad:
            counts = np.diff(np.asarray(ri.offsets, dtype=np.int64))
            keep = torch.ones(len(ri.request_ids), dtype=torch.bool)
            keep[bad] = False
            idx = keep.repeat_interleave(torch.from_numpy(counts)).nonzero().squeeze(1)
            _count_bad_labels(
                self.stats, int(counts[bad].sum()), ri.request_ids[bad[0]], tags[bad[0]]
            )
            rows = rows.take(idx)
        if self.cfg.labelled_only and self.cfg.label_tags:
            keep = ~torch.isnan(rows.label).any(1)
            if not bool(keep.all()):
                self.stats["unlabelled_rows"] = self.stats.get("unlabelled_rows", 0) + int(
                    (~keep).sum()
                )
                rows = rows.take(keep.nonzero().squeeze(1))
        if len(rows):
            self.hub.put(point_key(h.layer, h.hook), rows, self.stop_event)

    def _note(self, sub) -> None:
        from actbus.bus.fanin import FanIn

        now = time.monotonic()
        if isinstance(sub, FanIn) and now - self._pub_noted > 0.5:  # each publisher's own
            self._pub_noted = now
            rows = sub.per_publisher()
            for i, row in enumerate(rows.values()):
                for k in ("received", "missed", "lost", "publisher_dropped"):
                    self.stats[f"bus/pub{i}/{k}"] = row[k]
            self.stats["bus/lost"] = sum(r["lost"] for r in rows.values())
        s = sub.stats
        view = s.publisher_view or {}
        dropped = view.get("dropped", {})
        self.stats.update(
            {
                "bus/received": s.received,
                "bus/missed": s.missed,
                "bus/rejected": s.rejected,
                "bus/publisher_dropped": sum(dropped.values())
                if isinstance(dropped, dict)
                else dropped,
            }
        )
        if isinstance(view.get("routed"), int):  # what the publisher had for us, in all
            self.stats["bus/routed"] = view["routed"]


class RunSource(threading.Thread):
    """A stored run read with ``TokenDataset``, fed into a hub (streams interleaved)."""

    def __init__(self, cfg: DataConfig, hub: TokenHub, rank: int, world_size: int) -> None:
        super().__init__(name="actbus-trainer-run", daemon=True)
        self.cfg = cfg
        self.hub = hub
        self.rank = rank
        self.world_size = world_size
        self.stop_event = threading.Event()
        self.stats: dict[str, Any] = {"bad_label_rows": 0} if cfg.label_tags else {}
        self.welcomed = threading.Event()
        self.welcomed.set()
        self._labels = _load_labels(cfg.labels_file)
        self._counting = True
        self.info: dict[str, Any] = {"dataset_path": str(cfg.run_dir)}
        """What the run's manifest says of its stream (model, hidden_size, dtype)."""
        try:
            from consumers.fs import ActivationRun

            m = ActivationRun(cfg.run_dir).manifest
            self.info.update({k: m[k] for k in ("model", "hidden_size", "dtype") if m.get(k)})
        except (OSError, ValueError, KeyError):  # reading the run itself reports it
            pass

    def run(self) -> None:
        from consumers.fs.torch_dataset import TokenDataset

        cfg = self.cfg
        error = None
        try:
            datasets = {}
            for layer, hook in cfg.streams:
                datasets[point_key(layer, hook)] = TokenDataset(
                    cfg.run_dir,
                    layer,
                    hook,
                    batch_tokens=min(cfg.batch_tokens, 8192),
                    shuffle_buffer=0,  # the hub shuffles
                    seed=cfg.seed,
                    columns=("tags",) if cfg.label_tags and not self._labels else (),
                    rank=self.rank,
                    world_size=self.world_size,
                    match=cfg.match,  # the rule --match follows live, on the stored tags
                )
            rows = min(ds.count_rows() for ds in datasets.values())
            epochs = cfg.epochs or auto_epochs(rows, cfg.batch_tokens, self.world_size)
            steps = epochs * rows // max(self.world_size, 1) // cfg.batch_tokens
            log.info(
                "--from %s: %s rows per stream%s; %d pass%s over them (%s), about %s steps "
                "of %s tokens",
                cfg.run_dir,
                f"{rows:,}",
                " matching --match" if cfg.match else "",
                epochs,
                "" if epochs == 1 else "es",
                "--epochs" if cfg.epochs else "chosen for about 200 steps; --epochs sets it",
                f"{max(steps, 1):,}",
                f"{cfg.batch_tokens:,}",
            )
            for epoch in range(epochs):
                if self.stop_event.is_set():
                    break
                its = {}
                for key, ds in datasets.items():
                    ds.set_epoch(epoch)  # another order of shards and of rows
                    its[key] = iter(ds)
                self._counting = epoch == 0  # a bad row is one row, however many passes
                self._pass(its)
        except BaseException as e:
            error = e
        finally:
            _report_bad_labels(self.stats)
            self.hub.finish(error)

    def _pass(self, its: dict[str, Iterator[dict[str, Any]]]) -> None:
        """One pass over the run: the streams' chunks interleaved into the hub."""
        while its and not self.stop_event.is_set():
            for key in list(its):
                chunk = next(its[key], None)
                if chunk is None:
                    del its[key]
                    continue
                rows = self._rows(chunk)
                if len(rows):
                    self.hub.put(key, rows, self.stop_event)

    def _rows(self, chunk: dict[str, Any]) -> TrainingRows:
        rid = np.array(chunk["request_id"], dtype=object)
        n = len(rid)
        tags_cols = self.cfg.label_tags
        label = torch.full((n, len(tags_cols)), float("nan"))
        if tags_cols:
            if self._labels is not None:
                per = [self._labels.get(r, {}) for r in rid]
            else:
                per = [json.loads(t) if t else {} for t in chunk["tags"]]
            label, bad = parse_labels(per, tags_cols)
            if bad and self._counting:
                _count_bad_labels(self.stats, len(bad), rid[bad[0]], per[bad[0]])
        split = torch.tensor([split_value(r) for r in rid], dtype=torch.float64)
        rows = TrainingRows(chunk["activation"], chunk["position"], rid, split, label)
        if self.cfg.labelled_only and tags_cols:
            rows = rows.take((~torch.isnan(label).any(1)).nonzero().squeeze(1))
        return rows


def _count_bad_labels(stats: dict[str, Any], rows: int, request_id: str, tags: Any) -> None:
    """Rows whose label tag is not a number are skipped and counted (the first logged)."""
    if not stats.get("bad_label_rows"):
        log.warning(
            "request %r: a label tag is not a number (or is beyond float32's +-3.4e38; tags "
            "%.200r); its rows are skipped and counted as data/bad_label_rows",
            request_id,
            tags,
        )
    stats["bad_label_rows"] = stats.get("bad_label_rows", 0) + rows


def _report_bad_labels(stats: dict[str, Any]) -> None:
    if stats.get("bad_label_rows"):
        log.warning(
            "skipped %d rows whose label tag is not a number float32 holds (data/bad_label_rows)",
            stats["bad_label_rows"],
        )


def _load_labels(path: str | None) -> dict[str, dict[str, Any]] | None:
    if path is None:
        return None
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"labels_file {path}: expected a JSON object request_id -> {{tag: value}}")
    return data


def _pinned(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class TokenStream(IterableDataset):
    """Batches from a hub; starts its source on first iteration (on the rank that uses it)."""

    def __init__(self, cfg: DataConfig, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.hub = TokenHub(cfg)
        self.source: BusSource | RunSource | None = None
        self.stop_event = threading.Event()
        self._ended = False
        self.ledger: Any = None
        """A file to write every handed-out (request_id, position) to (tests, audits)."""

    def start(self) -> None:
        if self.source is not None:
            return
        if self.cfg.address is not None:
            group = self.cfg.group or (f"{self.cfg.name}-ddp" if self.world_size > 1 else "")
            self.source = BusSource(self.cfg, self.hub, group=group)
        else:
            self.source = RunSource(self.cfg, self.hub, self.rank, self.world_size)
        if self.stop_event.is_set() or self._ended:  # stopped before it started
            self.source.stop_event.set()
        self.source.start()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.start()
        for batch in self._batches():
            if batch is None:
                break
            if self.ledger is not None:
                for k, b in batch.items():
                    for r, p in zip(b["request_id"], b["position"].tolist(), strict=True):
                        self.ledger.write(f"{k}\t{r}\t{p}\n")
            yield batch
        if self.world_size > 1:  # keep step with the other ranks until all have ended
            while not self.stop_event.is_set():
                yield {"_exhausted": True, **{k: _empty(0).as_batch() for k in self.hub.keys}}

    def _batches(self) -> Iterator[dict[str, Any] | None]:
        """Batches from the hub, made ``cfg.prefetch`` ahead on a thread of their own.

        Drawing a batch (a random gather from the shuffle buffer) and pinning it (so
        Lightning's copy to the GPU runs asynchronously) then overlap the previous
        step's device work instead of adding to it: on an H100 (benchmarks/bench_sae.py
        --bus) a step fed from the bus took 57.8 ms drawn in the loop and 35.4 ms with
        this, against 33.9 ms for batches already in memory."""
        if self.cfg.prefetch == 0:
            while (batch := self.hub.next_batch(self.stop_event)) is not None:
                yield batch
            yield None
            return
        pin = torch.cuda.is_available()
        ready: queue.Queue = queue.Queue(maxsize=self.cfg.prefetch)

        def offer(item: Any) -> bool:
            while not self.stop_event.is_set():
                try:
                    ready.put(item, timeout=0.25)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                while True:
                    batch = self.hub.next_batch(self.stop_event)
                    if batch is not None and pin:
                        batch = {k: _pinned(b) for k, b in batch.items()}
                    if not offer(batch) or batch is None:
                        return
            except BaseException as e:  # handed to the trainer's thread, raised there
                offer(e)

        threading.Thread(target=produce, name="actbus-batches", daemon=True).start()
        while True:
            try:
                item = ready.get(timeout=0.25)
            except queue.Empty:
                if self.stop_event.is_set():
                    return
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item is None:
                return

    def first_step(self) -> None:
        self.hub.first_step()

    def stats(self) -> dict[str, float]:
        out = self.hub.stats()
        if self.source is not None:
            out.update({k: float(v) for k, v in self.source.stats.items()})
        return out

    def end(self) -> None:
        """End the stream as its publisher would: the source stops reading, and batches
        go on from what the buffers hold (the warm-up's too), then end. Only sets
        events, so a signal handler may call it."""
        self._ended = True
        if self.source is not None:
            self.source.stop_event.set()

    def stop(self) -> None:
        """Stop now: the source stops reading and the batches end soon after, whatever
        the buffers hold. Only sets events, so a signal handler may call it (``close``
        joins)."""
        self.stop_event.set()
        if self.source is not None:
            self.source.stop_event.set()

    def close(self) -> None:
        """Stop, wait for the source thread to end, close the ledger."""
        self.stop()
        if self.source is not None:
            self.source.join(timeout=10)
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None


class ActivationDataModule(LightningDataModule):
    """The same DataModule for a live publisher (``address``) or a stored run (``run_dir``)."""

    def __init__(self, cfg: DataConfig, ledger_path: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ledger_path = ledger_path
        self.stream: TokenStream | None = None
        self._stops = 0

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else 0
        world = trainer.world_size if trainer is not None else 1
        if self.stream is None:
            self.stream = TokenStream(self.cfg, rank=rank, world_size=world)
            if self.ledger_path:
                self.stream.ledger = open(f"{self.ledger_path}.rank{rank}", "w")  # noqa: SIM115
            if self._stops:
                self._stop_stream()
        # batch_size=None: the stream batches; workers=0: the source is a thread here.
        return DataLoader(self.stream, batch_size=None, num_workers=0)

    def stats(self) -> dict[str, float]:
        return self.stream.stats() if self.stream is not None else {}

    def first_step(self) -> None:
        """The trainer starts its first step (``DataStats``): the warm-up's lines end."""
        if self.stream is not None:
            self.stream.first_step()

    def stop(self) -> bool:
        """End the subscription (or the stored run's reading): the first call lets the
        trainer use what the buffers hold, then the epoch ends; a second ends it now.
        ``teardown`` then joins the source thread. Safe to call from a signal handler
        (Ctrl-C, SIGTERM), and before the stream exists (it then starts stopped).
        True on the first call."""
        self._stops += 1
        if self.stream is not None:
            self._stop_stream()
        return self._stops == 1

    def _stop_stream(self) -> None:
        assert self.stream is not None
        if self._stops == 1:
            self.stream.end()
        else:
            self.stream.stop()

    def stream_info(self) -> dict[str, Any]:
        """What is known of the data so far, for checkpoints: the publisher's (or the
        stored run's) ``model`` and more, ``context_size`` (the highest token position
        seen + 1) and, for a stored run, ``dataset_path``."""
        s = self.stream
        if s is None or s.source is None:
            return {}
        keep = ("model", "hidden_size", "dtype", "dataset_path")
        out = {k: s.source.info[k] for k in keep if s.source.info.get(k) is not None}
        if self.cfg.address is not None:
            out["address"] = self.cfg.address
        if s.hub.max_position >= 0:
            out["context_size"] = s.hub.max_position + 1
        return out

    def teardown(self, stage: str) -> None:
        if self.stream is not None:
            self.stream.close()
