"""``actbus run sae|probe``: train from a live publisher (--connect) or a stored run (--from).

The trainers are not ``Consumer`` plugins: Lightning owns the loop, the subscriber
lives on the DataModule's thread (one per rank under DDP, each a member of one
load-balancing group), and a stored run needs no publisher at all. So they are
registered under their own entry-point group, ``actbus.trainers``, which
``actbus run`` looks in first; each entry point is a ``main(argv) -> int``.

    actbus run sae --connect ipc:///tmp/actbus.sock --layer 8 --kind topk --k 32 --expansion 16
    actbus run sae --from out/run --layer 8,16 --k 32,64          # 4 SAEs, one pass
    actbus run probe --connect ADDR --layer 8 --label label --heldout 0.2
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from actbus.flags import int_list
from trainers.config import SAE_KINDS, DataConfig, ProbeConfig, SAEConfig

log = logging.getLogger("actbus.trainers")


def _strs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _common(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("source (exactly one)")
    src.add_argument("--connect", help="publisher address, e.g. ipc:///tmp/actbus.sock")
    src.add_argument("--from", dest="run_dir", help="a run directory the fs sink wrote")
    src.add_argument("--layer", type=int_list, required=True, help="layer(s), comma-separated")
    src.add_argument("--hook", type=_strs, default=["post_block"], help="hook(s), comma-separated")
    src.add_argument("--d-in", type=int, help="input width (default: from the publisher or run)")
    d = p.add_argument_group("data")
    d.add_argument("--policy", default="drop_oldest", help="bus policy (default drop_oldest)")
    d.add_argument("--window", type=int, default=64)
    d.add_argument("--window-mb", type=float, default=128.0)
    d.add_argument("--group", default="", help="load-balancing group (DDP sets one itself)")
    d.add_argument("--tags", help='keep only requests whose tags match, JSON: {"split": "train"}')
    d.add_argument("--batch-tokens", type=int, default=4096)
    d.add_argument("--buffer-tokens", type=int, default=65536, help="shuffle buffer per stream")
    d.add_argument("--warmup-tokens", type=int, default=16384)
    d.add_argument("--max-tokens", type=int, help="stop after this many tokens per stream")
    d.add_argument("--idle-s", type=float, help="live: stop after this long without data")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--server-key")
    d.add_argument("--client-secret-key")
    t = p.add_argument_group("training")
    t.add_argument("--lr", type=float, help="learning rate")
    t.add_argument("--accelerator", default="auto")
    t.add_argument("--devices", default="1", help="devices per node (DDP when more than 1)")
    t.add_argument("--strategy", default="auto")
    t.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    t.add_argument("--out", default="out/trainers", help="checkpoints and the W&B run go here")
    t.add_argument("--checkpoint-every", type=int, default=1000, help="optimizer steps")
    t.add_argument("--log-every", type=int, default=10, help="steps between logged metrics")
    t.add_argument(
        "--wandb-project",
        default=os.environ.get("WANDB_PROJECT", "actbus"),
        help="W&B project (default $WANDB_PROJECT or actbus); group: $WANDB_RUN_GROUP",
    )
    t.add_argument("--run-name", default=None)
    t.add_argument("--no-progress", action="store_true", help="no rich progress bar")
    t.add_argument("--ledger", help=argparse.SUPPRESS)  # every trained (request, position)
    t.add_argument("--summary", help="write final metrics as JSON to this file")


def _sae_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="actbus run sae",
        description="Train sparse autoencoders (one per layer x hook x k x expansion).",
    )
    _common(p)
    s = p.add_argument_group("SAE")
    s.add_argument("--kind", choices=SAE_KINDS, default="topk")
    s.add_argument("--k", type=int_list, default=[32], help="k, comma-separated for several")
    s.add_argument("--expansion", type=int_list, default=[16], help="d_sae / d_in, comma-separated")
    s.add_argument("--aux-k", type=int, help="AuxK dead latents (default d_in/2; 0: off)")
    s.add_argument("--aux-coeff", type=float, default=1 / 32)
    s.add_argument("--dead-tokens", type=int, default=10_000_000)
    s.add_argument("--l1-coeff", type=float, default=0.2)
    s.add_argument("--l0-coeff", type=float, default=0.01)
    s.add_argument("--b-dec-init", default="geometric_median")
    s.add_argument("--no-normalize", action="store_true", help="no input scaling")
    s.add_argument("--decoder", default="sparse", choices=("sparse", "dense"))
    return p


def _probe_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="actbus run probe",
        description="Train linear probes on request-tag labels, one head per --label tag.",
    )
    _common(p)
    s = p.add_argument_group("probe")
    s.add_argument("--label", type=_strs, default=["label"], help="request tag(s) to predict")
    s.add_argument("--kind", choices=("logistic", "linear"), default="logistic")
    s.add_argument("--heldout", type=float, default=0.2, help="fraction of requests held out")
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--labels-file", help="stored runs: JSON request_id -> {tag: value}")
    return p


def _d_in(opts: argparse.Namespace) -> int:
    if opts.d_in:
        return opts.d_in
    if opts.run_dir:
        from consumers.fs import ActivationRun

        return ActivationRun(opts.run_dir).hidden_size
    from actbus.bus import Subscriber, Subscription

    with Subscriber(
        opts.connect,
        Subscription(layers=(), name="trainer-probe-width"),
        server_key=opts.server_key,
        client_secret_key=opts.client_secret_key,
    ) as sub:
        info = sub.wait_welcome(timeout=60)
    if "hidden_size" not in info:
        raise ValueError("the publisher does not announce hidden_size; pass --d-in")
    return int(info["hidden_size"])


def _data_cfg(opts: argparse.Namespace, name: str, **kw: Any) -> DataConfig:
    from actbus.bus.protocol import parse_match, parse_policy

    parse_policy(opts.policy)  # a bad policy fails here, naming it
    return DataConfig(
        streams=tuple(itertools.product(opts.layer, opts.hook)),
        address=opts.connect,
        run_dir=opts.run_dir,
        batch_tokens=opts.batch_tokens,
        buffer_tokens=opts.buffer_tokens,
        warmup_tokens=opts.warmup_tokens,
        max_tokens=opts.max_tokens,
        idle_s=opts.idle_s,
        policy=opts.policy,
        window=opts.window,
        window_mb=opts.window_mb,
        group=opts.group,
        tags=parse_match(opts.tags) if opts.tags else None,
        seed=opts.seed,
        name=name,
        server_key=opts.server_key,
        client_secret_key=opts.client_secret_key,
        **kw,
    )


def _fit(module, data_cfg: DataConfig, opts: argparse.Namespace, configs: list) -> dict:
    import lightning.pytorch as pl

    from trainers.callbacks import DataStats, MetricsProgressBar, SaveSAEs
    from trainers.data import ActivationDataModule
    from trainers.wandb_log import make_logger

    out = Path(opts.out)
    dm = ActivationDataModule(data_cfg, ledger_path=opts.ledger)
    name = opts.run_name or data_cfg.name
    logger = make_logger(
        opts.wandb_project,
        name,
        out,
        {"data": {k: v for k, v in vars(data_cfg).items() if k != "extra"}}
        | {"models": [c.to_dict() for c in configs]},
    )
    callbacks: list = [DataStats(dm, opts.log_every)]
    if hasattr(module, "saes"):
        callbacks.append(SaveSAEs(out, opts.checkpoint_every))
    if not opts.no_progress:
        callbacks.append(MetricsProgressBar())
    devices: Any = int(opts.devices) if str(opts.devices).isdigit() else opts.devices
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator=opts.accelerator,
        devices=devices,
        strategy=opts.strategy,
        precision=opts.precision,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=opts.log_every,
        enable_checkpointing=False,
        enable_progress_bar=not opts.no_progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    stop = threading.Event()

    def _stop(*_: Any) -> None:  # Ctrl-C / SIGTERM: end the stream, save, exit cleanly
        stop.set()
        if dm.stream is not None:
            dm.stream.stop_event.set()
            if dm.stream.source is not None:
                dm.stream.source.stop_event.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop)
    trainer.fit(module, datamodule=dm)
    summary = {
        "rank": trainer.global_rank,
        "steps": trainer.global_step,
        "metrics": {k: float(v) for k, v in getattr(module, "last_metrics", {}).items()},
        "data": dm.stats(),
        "wandb_dir": str(out / "wandb"),
    }
    if hasattr(module, "fvu_history"):
        summary["fvu_history"] = module.fvu_history
    if hasattr(module, "probes") and trainer.is_global_zero:
        from trainers.checkpoint import save_probe
        from trainers.sae_module import module_key

        for c in configs:
            m = {k: v for k, v in summary["metrics"].items() if k.startswith(f"{c.name}/")}
            save_probe(module.probes[module_key(c.name)], out / c.name, metrics=m)
    if opts.summary and trainer.is_global_zero:
        Path(opts.summary).write_text(json.dumps(summary))
    return summary


def _parse(
    parser: argparse.ArgumentParser, argv: list[str] | None, build: Any
) -> tuple[argparse.Namespace, list[Any], DataConfig]:
    """Flags, then ``build(opts, d_in) -> (configs, data config)``; a bad value or an
    unreachable source ends the command with the parser's error, naming it."""
    opts = parser.parse_args(argv)
    if (opts.connect is None) == (opts.run_dir is None):
        parser.error("give exactly one source: --connect ADDR (live) or --from DIR (a stored run)")
    try:
        configs, data_cfg = build(opts, _d_in(opts))
    except (ValueError, TimeoutError, FileNotFoundError) as e:
        parser.error(str(e))
    return opts, configs, data_cfg


def _sae_configs(opts: argparse.Namespace, d_in: int) -> tuple[list[SAEConfig], DataConfig]:
    configs = [
        SAEConfig(
            d_in=d_in,
            kind=opts.kind,
            k=k,
            expansion=x,
            aux_k=opts.aux_k,
            aux_coeff=opts.aux_coeff,
            dead_tokens=opts.dead_tokens,
            l1_coeff=opts.l1_coeff,
            l0_coeff=opts.l0_coeff,
            b_dec_init=opts.b_dec_init,
            normalize=not opts.no_normalize,
            decoder=opts.decoder,
            layer=layer,
            hook=hook,
            seed=opts.seed,
            **({"lr": opts.lr} if opts.lr else {}),
        )
        for layer, hook, k, x in itertools.product(opts.layer, opts.hook, opts.k, opts.expansion)
    ]
    return configs, _data_cfg(opts, name="sae")


def _probe_configs(opts: argparse.Namespace, d_in: int) -> tuple[list[ProbeConfig], DataConfig]:
    configs = [
        ProbeConfig(
            d_in=d_in,
            labels=tuple(opts.label),
            kind=opts.kind,
            heldout=opts.heldout,
            weight_decay=opts.weight_decay,
            layer=layer,
            hook=hook,
            seed=opts.seed,
            **({"lr": opts.lr} if opts.lr else {}),
        )
        for layer, hook in itertools.product(opts.layer, opts.hook)
    ]
    data_cfg = _data_cfg(
        opts,
        name="probe",
        label_tags=tuple(opts.label),
        labelled_only=True,
        labels_file=opts.labels_file,
    )
    return configs, data_cfg


def sae_main(argv: list[str] | None = None) -> int:
    opts, configs, data_cfg = _parse(_sae_parser(), argv, _sae_configs)
    from trainers.sae_module import SAETrainer

    _fit(SAETrainer(configs), data_cfg, opts, configs)
    return 0


def probe_main(argv: list[str] | None = None) -> int:
    opts, configs, data_cfg = _parse(_probe_parser(), argv, _probe_configs)
    from trainers.probe import ProbeTrainer

    _fit(ProbeTrainer(configs, tuple(opts.label)), data_cfg, opts, configs)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("ACTBUS_LOG", "INFO"))
    sys.exit({"sae": sae_main, "probe": probe_main}[sys.argv[1]](sys.argv[2:]))
