"""W&B dashboard consumer: bus health and activation statistics, logged to W&B.

``actbus run wandb --connect ADDR --project P [--wandb-group G] [--policy sample:5/s]``

Every ``--interval`` seconds it logs one row: the publisher's health (steps/s,
tokens/s, bytes/s, per-subscriber lag, drops by reason, spill size, from the
publisher's own counters), what this consumer sampled (steps counted, messages,
drops), and per (layer, hook) the per-token norm histogram, mean/variance and
their drift, the outlier-dimension fraction and the rows holding a NaN or an
infinity (``acts/nonfinite_rows`` in all), plus per-tag breakdowns; and, when the
engine has monitors, their scores under ``monitor/`` (``flatten_monitors``); when it
taps a mixture-of-experts router, the expert load per layer under ``experts/``
(``flatten_experts``).

Convention: capture and training share one W&B project and group, so one
workspace shows both; set ``WANDB_PROJECT`` and ``WANDB_RUN_GROUP`` once (W&B reads
them), or pass ``--project``/``--wandb-group`` here and the same to the trainers.
This run's ``job_type`` is ``bus``. ``WANDB_MODE=offline`` works, and without W&B
credentials the run is offline too (said in the log, as the trainers do); ``wandb
sync`` uploads it later. (``--group`` is taken by ``actbus run``: it is the bus's
load-balancing group, hence ``--wandb-group``.)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Any

import numpy as np

from actbus.streams import parse_point_key, point_key
from consumers.sampler import DashboardSampler
from consumers.scores import ScoreStatsConfig
from consumers.wandb_offline import has_credentials, offline_mode

log = logging.getLogger("actbus.wandb")

DEFAULT_PROJECT = "actbus"


def _name(text: str) -> str:
    """A metric path segment: W&B splits keys on '/', so none inside a segment."""
    return re.sub(r"[^A-Za-z0-9_.=:+-]", "_", str(text))


def flatten(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot as one W&B row; histograms as ``(counts, edges)`` pairs."""
    bus, me, acts = snap.get("bus") or {}, snap["me"], snap["acts"]
    row: dict[str, Any] = {}
    for k in (
        "steps_per_s",
        "tokens_per_s",
        "tokens",
        "bytes_per_s",
        "messages_per_s",
        "published",
        "last_step",
        "source_drops",
        "drops_total",
        "spill_bytes",
        "queued_bytes",
        "stall_s",
        "capture_s",
        "capture_frac",
        "publisher_cpu_frac",
        "latency_p50_ms",
        "latency_p99_ms",
        "subscribers",
    ):
        if k in bus:
            row[f"bus/{k}"] = bus[k]
    for reason, n in (bus.get("drops") or {}).items():
        row[f"bus/drops/{_name(reason)}"] = n
    for sub, lag in (bus.get("lag_steps") or {}).items():
        row[f"bus/lag_steps/{_name(sub)}"] = lag
    row["sampled/sample_every"] = snap.get("sample_every", 1)
    row["sampled/sample_per_s"] = snap.get("sample_per_s", 0.0)
    row["sampled/steps_counted"] = me["steps_counted"]
    row["sampled/received"] = me["received"]
    row["sampled/routed"] = me["routed"]
    row["sampled/sent"] = me["sent"]
    row["sampled/sampled_out"] = me["sampled_out"]
    row["sampled/dropped"] = sum(me["dropped"].values())
    row["sampled/rows"] = acts["rows"]
    row["sampled/last_step"] = acts["last_step"]
    row["acts/nonfinite_rows"] = acts.get("nonfinite_rows", 0)
    for t in acts["taps"].values():
        base = f"acts/{point_key(t['layer'], _name(t['hook']))}"
        for k in (
            "rows",
            "nonfinite_rows",
            "norm_mean",
            "norm_std",
            "norm_p50",
            "norm_max",
            "act_mean",
            "act_var",
            "mean_drift",
            "var_drift",
            "outlier_frac",
        ):
            if k in t:
                row[f"{base}/{k}"] = t[k]
        if "norm_hist" in t:
            h = t["norm_hist"]
            row[f"{base}/norm_hist"] = (np.asarray(h["counts"]), np.asarray(h["edges"]))
    pubs = snap.get("publishers") or {}
    for addr, v in pubs.items() if len(pubs) > 1 else ():  # fan-in: a panel each
        name = f"dp{v['dp_rank']}" if v.get("dp_rank") is not None else _name(addr)
        for k in ("messages", "rows", "last_step"):
            row[f"publishers/{name}/{k}"] = v[k]
    for label, per in (acts.get("tags") or {}).items():
        for key, v in per.items():
            base = f"tags/{_name(label)}/{point_key(*parse_point_key(key))}"
            row[f"{base}/rows"] = v["rows"]
            row[f"{base}/norm_mean"] = v["norm_mean"]
    row.update(flatten_monitors(snap.get("monitors") or {}))
    row.update(flatten_experts(snap.get("experts") or {}))
    return row


HISTOGRAM_BINS = 512
"""W&B's largest histogram: more experts than this are summed in equal runs of ids."""


def _expert_histogram(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` over expert ids: one bin per expert, or per run of
    ``ceil(E / 512)`` adjacent experts past 512 of them."""
    per = -(-len(counts) // HISTOGRAM_BINS)
    if per > 1:
        counts = np.pad(counts, (0, -len(counts) % per)).reshape(-1, per).sum(1)
    return counts, np.arange(len(counts) + 1, dtype=np.float64) * per


def flatten_experts(e: dict[str, Any]) -> dict[str, Any]:
    """Expert load under ``experts/``: per layer the tokens counted, the imbalance
    (busiest expert over the mean), and each expert's token count as a histogram
    over expert ids (``(counts, edges)``: one W&B chart per layer, whatever the
    number of experts); the rows refused and missed."""
    row: dict[str, Any] = {}
    for layer, v in (e.get("layers") or {}).items():
        base = f"experts/L{_name(layer)}"
        row[f"{base}/tokens"] = v["tokens"]
        row[f"{base}/imbalance"] = v["imbalance"]
        row[f"{base}/load"] = _expert_histogram(np.asarray(v["counts"], np.int64))
    if e.get("layers") is not None and "num_experts" in e:
        row["experts/bad_rows"] = e.get("bad_rows", 0)
        row["experts/missed"] = e.get("missed", 0)
    return row


def column_name(label: int | None, index: int) -> str:
    """A score column's metric segment: ``f17`` for SAE latent 17, ``c0`` otherwise."""
    return f"f{label}" if label is not None else f"c{index}"


def flatten_monitors(m: dict[str, Any]) -> dict[str, Any]:
    """Monitor scores under ``monitor/``: per monitor, layer and column the mean since
    the start, the recent mean, p90, max and share above the threshold, the weights'
    version; per tag each column's mean (``monitor/tags/TAG/NAME.LLAYER/COLUMN``)."""
    row: dict[str, Any] = {}
    labels: dict[str, list[str]] = {}
    for skey, s in (m.get("series") or {}).items():
        base = f"monitor/{_name(s['monitor'])}/L{s['layer']}"
        for k in ("version", "rows", "nonfinite_rows"):
            row[f"{base}/{k}"] = s[k]
        names = labels[skey] = [
            column_name(c.get("label"), i) for i, c in enumerate(s.get("columns") or [])
        ]
        for name, c in zip(names, s.get("columns") or [], strict=True):
            for k in ("mean", "recent_mean", "p90", "max", "above"):
                if c.get(k) is not None:
                    row[f"{base}/{name}/{k}"] = c[k]
    if m.get("missed"):
        row["monitor/missed"] = m["missed"]
    for label, per in (m.get("tags") or {}).items():
        for skey, v in per.items():
            name, _, layer = skey.rpartition("@")
            base = f"monitor/tags/{_name(label)}/{_name(name)}.L{layer}"
            row[f"{base}/rows"] = v["rows"]
            cols = labels.get(skey) or []
            for i, mean in enumerate(v["means"]):
                row[f"{base}/{cols[i] if i < len(cols) else f'c{i}'}/mean"] = mean
    return row


class WandbDashboard(DashboardSampler):
    """Logs each snapshot as one W&B row (histograms as ``wandb.Histogram``)."""

    name = "wandb"

    def __init__(
        self,
        address: str,
        *,
        project: str = DEFAULT_PROJECT,
        group: str | None = None,
        run_name: str | None = None,
        wandb_dir: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(address, **kw)
        import wandb

        self._wandb = wandb
        offline = offline_mode()
        if offline and not has_credentials() and os.environ.get("WANDB_MODE") != "offline":
            log.warning(
                "no W&B credentials (WANDB_API_KEY, or `wandb login`): logging offline under "
                "%s; upload later with `wandb sync`",
                os.path.join(wandb_dir or os.environ.get("WANDB_DIR") or ".", "wandb"),
            )
        self.run = wandb.init(
            project=project,
            group=group or None,
            name=run_name or None,
            job_type="bus",
            dir=wandb_dir or None,
            config={"actbus": {"connect": address, "interval_s": self.interval_s}},
            reinit="finish_previous",
            # Said to wandb.init itself: WANDB_MODE is read once per process.
            **({"mode": "offline"} if offline else {}),
        )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--project",
            "--wandb-project",  # the trainers' spelling
            dest="project",
            default=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            help="W&B project (default $WANDB_PROJECT or 'actbus'); trainers use the same",
        )
        parser.add_argument(
            "--wandb-group",
            default=os.environ.get("WANDB_RUN_GROUP"),
            help="W&B run group shared with the trainers (default $WANDB_RUN_GROUP)",
        )
        parser.add_argument("--run-name", default=None, help="W&B run name (default: W&B's)")
        parser.add_argument(
            "--wandb-dir", default=None, help="where W&B writes its run files (default ./wandb)"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WandbDashboard:
        return cls(
            args.connect,
            project=args.project,
            group=args.wandb_group,
            run_name=args.run_name,
            wandb_dir=args.wandb_dir,
            recent=None,
            score_config=ScoreStatsConfig(keep_requests=0),  # per-token scores: the web page's
            **cls.common_kwargs(args),
        )

    def on_welcome(self, info: dict[str, Any]) -> None:
        super().on_welcome(info)
        self.run.config.update(
            {
                "actbus": {
                    "model": info.get("model", ""),
                    "sample_every": self.sample_every,
                    "sample_per_s": self.sample_per_s,
                }
            },
            allow_val_change=True,
        )

    def report(self, snap: dict[str, Any]) -> None:
        row = flatten(snap)
        for k, v in row.items():
            if isinstance(v, tuple):
                row[k] = self._wandb.Histogram(np_histogram=v)
        self.run.log(row)

    def close(self) -> None:
        try:
            self.flush()  # the last figures, so the run ends with the final counts
        finally:
            super().close()
            self.run.finish()
