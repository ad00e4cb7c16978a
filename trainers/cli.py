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

from actbus.bus.options import SubscriberOptions
from actbus.flags import HelpFormatter, add_fields, name_flag, sweeps, values
from actbus.logcap import show_own_logs
from trainers.config import DataConfig, ProbeConfig, SAEConfig

log = logging.getLogger("actbus.trainers")

MODEL_FROM_SOURCE = ("d_in", "layer", "hook", "name", "seed")
"""Model fields set from the source and the stream, not by a flag of their own."""
DATA_FLAGS = (
    "batch_tokens",
    "buffer_tokens",
    "warmup_tokens",
    "max_tokens",
    "idle_s",
    "epochs",
    "seed",
)
DATA_DEFAULTS = {"buffer_tokens": 65536, "warmup_tokens": 4096}
"""The command's shuffle is smaller than DataConfig's, and its warm-up one batch, so
training starts as soon as a batch's worth arrived (the README's few requests make a
few batches)."""


def _parser(kind: str, model: type, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"actbus run {kind}", description=description, formatter_class=HelpFormatter
    )
    src = p.add_argument_group("source (exactly one)")
    SubscriberOptions.add_arguments(src, only=("connect",), required=())
    src.add_argument("--from", dest="run_dir", help="a run directory the fs sink wrote")
    SubscriberOptions.add_arguments(
        src, only=("layers", "hooks"), defaults={"hooks": ("post_block",)}, required=("layers",)
    )
    src.add_argument("--d-in", type=int, help="input width (default: from the publisher or run)")
    d = p.add_argument_group("data")
    SubscriberOptions.add_arguments(
        d,
        exclude=("connect", "layers", "hooks"),
        defaults={"policy": "drop_oldest", "name": kind},
        required=(),
    )
    add_fields(d, DataConfig, only=DATA_FLAGS, defaults=DATA_DEFAULTS)
    if model is ProbeConfig:
        add_fields(d, DataConfig, only=("labels_file",))
    add_fields(p.add_argument_group(kind), model, exclude=MODEL_FROM_SOURCE)
    t = p.add_argument_group("training")
    t.add_argument("--accelerator", default="auto", help="Lightning accelerator: cpu, gpu...")
    t.add_argument("--devices", default="1", help="devices per node (DDP when more than 1)")
    t.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        help="hosts in the DDP cluster; each host runs this command with the same flags and "
        "Lightning's NODE_RANK, MASTER_ADDR and MASTER_PORT set",
    )
    t.add_argument("--strategy", default="auto", help="Lightning strategy, e.g. ddp")
    t.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    t.add_argument("--out", default="out/trainers", help="checkpoints and the W&B run go here")
    t.add_argument("--checkpoint-every", type=int, default=1000, help="optimizer steps")
    t.add_argument("--log-every", type=int, default=10, help="steps between logged metrics")
    t.add_argument(
        "--max-duty",
        type=float,
        default=1.0,
        help="the most of wall time spent in training steps, resting after each (default "
        "1: never rests); on the engine's GPU, with a lossy --policy, it caps what training "
        "costs generation, and what the trainer cannot take is dropped and counted",
    )
    t.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch's CPU threads (default: all cores when training on the CPU, else at most "
        "4: batches are drawn and pinned on the CPU, and an engine on the same host needs "
        "its cores more than spinning thread pools do)",
    )
    t.add_argument(
        "--wandb-project",
        default=os.environ.get("WANDB_PROJECT", "actbus"),
        help="W&B project (default $WANDB_PROJECT or actbus); group: $WANDB_RUN_GROUP",
    )
    t.add_argument("--run-name", default=None, help="W&B run name (default: --name)")
    t.add_argument("--no-progress", action="store_true", help="no rich progress bar")
    t.add_argument("--ledger", help=argparse.SUPPRESS)  # every trained (request, position)
    t.add_argument("--summary", help="write final metrics as JSON to this file")
    _push_arguments(
        p.add_argument_group("live pushes to a serving engine's monitor or steering vector"), kind
    )
    return p


def _cpu_threads(asked: int | None, accelerator: str) -> None:
    """Size torch's CPU thread pool. Training on a GPU uses the CPU only to draw and pin
    batches; torch's default pool (one thread per core) then spins on cores that the
    engine, usually on the same host, needs for scheduling and output processing."""
    import torch

    if asked is None and (accelerator == "cpu" or not torch.cuda.is_available()):
        return
    torch.set_num_threads(asked or min(4, os.cpu_count() or 1))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _push_arguments(g: argparse._ArgumentGroup, kind: str) -> None:
    g.add_argument(
        "--push",
        metavar="ADDR",
        help="the engine's control endpoint (its actbus.control): push this model's weights "
        "to one of its monitors as training goes",
    )
    g.add_argument("--push-every", type=int, default=100, help="optimizer steps between pushes")
    g.add_argument(
        "--push-monitor",
        metavar="NAME",
        help="the engine's monitor to update (default: the model's --name)",
    )
    g.add_argument(
        "--push-vector",
        metavar="NAME",
        help="push into the engine's live steering vector NAME (its actbus.steer.live) "
        "instead of a monitor: the probe head's unit direction, or the unit decoder row "
        "of the one latent --push-features names",
    )
    if kind == "probe":
        g.add_argument("--push-head", metavar="LABEL", help="the label whose head is pushed")
    else:
        g.add_argument(
            "--push-features",
            metavar="I,J,...",
            help="the latents the engine's monitor scores, in its order (its 'features'); "
            "with --push-vector: the one latent whose decoder row is pushed",
        )
    g.add_argument("--push-server-key", help="CURVE: the engine's server.key")
    g.add_argument("--push-client-secret-key", help="CURVE: this trainer's NAME.key_secret")


def _push_target(opts: argparse.Namespace, configs: list) -> Any:
    """What ``--push`` updates (a ``PushTarget``), checked with the other flags; or None."""
    if not opts.push:
        return None
    from trainers.push import PushTarget

    if len(configs) != 1:
        raise ValueError(
            f"--push: this run trains {len(configs)} models; a push updates one monitor "
            "from one model (give single values to the sweep flags)"
        )
    c = configs[0]
    kind = "probe" if isinstance(c, ProbeConfig) else "sae"
    features: tuple[int, ...] = ()
    if kind == "sae":
        raw = getattr(opts, "push_features", None)
        if not raw:
            raise ValueError("--push-features: required with --push for an SAE")
        try:
            features = tuple(int(x) for x in str(raw).split(","))
        except ValueError:
            raise ValueError(
                f"--push-features: expected I,J,... latent indices, got {raw!r}"
            ) from None
    if opts.push_every < 1:
        raise ValueError(f"--push-every: expected a number of steps >= 1, got {opts.push_every}")
    vector = getattr(opts, "push_vector", None)
    if vector is not None:
        if opts.push_monitor:
            raise ValueError(
                "--push-vector: a push updates one monitor or one live vector; drop "
                "--push-monitor or --push-vector"
            )
        if kind == "sae" and len(features) != 1:
            raise ValueError(
                f"--push-features: with --push-vector give the one latent whose decoder row "
                f"is pushed, got {len(features)}"
            )
        if kind == "sae" and not 0 <= features[0] < c.d_sae:
            raise ValueError(
                f"--push-features: latent {features[0]} is out of range; the SAE has "
                f"{c.d_sae} latents"
            )
    return PushTarget(
        name=vector or opts.push_monitor or c.name,
        model=c.name,
        kind=kind,
        head=getattr(opts, "push_head", None),
        features=features,
        into="monitor" if vector is None else "vector",
    )


def _push_callback(opts: argparse.Namespace) -> Any:
    """The ``PushWeights`` callback ``--push`` asks for, or None."""
    if opts.push_target is None:
        return None
    from trainers.push import PushWeights

    return PushWeights(
        opts.push,
        opts.push_target,
        opts.push_every,
        server_key=opts.push_server_key,
        client_secret_key=opts.push_client_secret_key,
    )


def _sae_parser() -> argparse.ArgumentParser:
    return _parser(
        "sae", SAEConfig, "Train sparse autoencoders (one per layer x hook x k x expansion)."
    )


def _probe_parser() -> argparse.ArgumentParser:
    return _parser(
        "probe",
        ProbeConfig,
        "Train linear probes on request-tag labels, one head per --label tag.",
    )


def _d_in(opts: argparse.Namespace, sub: SubscriberOptions) -> int:
    """The input width: ``--d-in``, the run's, or the publisher's (whose WELCOME also
    says what it taps: a layer or hook it does not tap is refused here, at once)."""
    if opts.d_in:
        return opts.d_in
    if opts.run_dir:
        from consumers.fs import ActivationRun

        return ActivationRun(opts.run_dir).hidden_size
    from actbus.bus import Subscription
    from actbus.bus.subscriber import check_taps

    asked = (
        f"{'all layers' if sub.layers is None else f'layers {list(sub.layers)}'}, "
        f"{'all hooks' if sub.hooks is None else f'hooks {list(sub.hooks)}'} "
        f"(policy {sub.policy}; first the publisher's width)"
    )
    with sub.subscribe(Subscription(layers=(), name="trainer-probe-width"), waiting_for=asked) as s:
        info = s.wait_welcome(timeout=60)
    check_taps(sub.connect or "", info, sub.layers, sub.hooks)  # refused: SubscriptionRejected
    if "hidden_size" not in info:
        raise ValueError("the publisher does not announce hidden_size; pass --d-in")
    return int(info["hidden_size"])


def _data_cfg(opts: argparse.Namespace, sub: SubscriberOptions, **kw: Any) -> DataConfig:
    return DataConfig(
        streams=tuple(itertools.product(sub.layers or (), sub.hooks or ())),
        address=sub.connect,
        run_dir=opts.run_dir,
        policy=sub.policy,
        window=sub.window,
        window_mb=sub.window_mb,
        group=sub.group,
        match=sub.match,
        name=sub.name,
        **sub.keys,
        **values(opts, DataConfig, only=DATA_FLAGS),
        **kw,
    )


def _models(model: type, opts: argparse.Namespace, sub: SubscriberOptions, d_in: int) -> list:
    """One config per stream and per value of each swept field (``--k 32,64``)."""
    kw = values(opts, model, exclude=MODEL_FROM_SOURCE)
    swept = sweeps(model)
    grid = itertools.product(sub.layers or (), sub.hooks or (), *(kw[n] for n in swept))
    out = [
        model(
            d_in=d_in,
            layer=layer,
            hook=hook,
            seed=opts.seed,
            **{**kw, **dict(zip(swept, v, strict=True))},
        )
        for layer, hook, *v in grid
    ]
    seen: set[str] = set()
    for cfg in out:  # e.g. --k 32,64 with --kind relu, which has no k
        if cfg.name in seen:
            raise ValueError(
                f"two models would be saved as {cfg.name!r}: drop the sweep values this "
                "kind does not use, or give --name"
            )
        seen.add(cfg.name)
    return out


def _fit(module, data_cfg: DataConfig, opts: argparse.Namespace, configs: list) -> dict:
    import lightning.pytorch as pl

    from trainers.callbacks import DataStats, DutyCycle, MetricsProgressBar
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

    trainer: Any = None

    def _stop(*_: Any) -> None:  # Ctrl-C / SIGTERM: end the stream, save, exit cleanly
        # Lightning puts its own SIGTERM handler in front of this one at the start of
        # fit (ours is called after it); its flag would make the training loop raise
        # after the next step, skipping the end of the fit and its checkpoint.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector.received_sigterm = False
        if dm.stop():
            log.warning(
                "stopping: no more data is read; training on what is buffered, then saving "
                "(Ctrl-C again: stop now)"
            )
        else:
            log.warning("stopping now; saving what was trained")

    class StopOnSignal(pl.Callback):
        """Once training runs, this command's handlers alone (Lightning's are no use)."""

        def on_train_start(self, trainer, pl_module) -> None:
            _on_signals(_stop)

    duty = DutyCycle(opts.max_duty)
    if opts.max_duty < 1.0 and data_cfg.policy == "block":
        log.warning(
            "--max-duty %g with --policy block: the engine waits while the trainer rests; "
            "use a lossy policy (drop_oldest) to cap what training costs generation",
            opts.max_duty,
        )
    callbacks: list = [DataStats(dm, opts.log_every), StopOnSignal(), duty]  # + the module's
    push = _push_callback(opts)
    if push is not None:
        callbacks.append(push)
    if not opts.no_progress:
        callbacks.append(MetricsProgressBar(dm, data_cfg.policy if data_cfg.address else None))
    devices: Any = int(opts.devices) if str(opts.devices).isdigit() else opts.devices
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator=opts.accelerator,
        devices=devices,
        num_nodes=opts.num_nodes,
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

    _on_signals(_stop)
    trainer.fit(module, datamodule=dm)
    summary = {
        "rank": trainer.global_rank,
        "steps": trainer.global_step,
        **module.fit_summary(),
        "duty": round(duty.duty, 4),
        **(_bus_summary(dm.stats(), data_cfg.policy) if data_cfg.address else {}),
        "cpu_threads": _torch_threads(),
        **({"push": vars(push.stats)} if push is not None else {}),
        "data": dm.stats(),
        "wandb_dir": str(out / "wandb"),
    }
    if opts.summary and trainer.is_global_zero:
        Path(opts.summary).write_text(json.dumps(summary))
    if trainer.is_global_zero:
        _report(trainer.global_step, dm, data_cfg, out, configs)
    return summary


def _on_signals(handler: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)


def _report(steps: int, dm: Any, data_cfg: DataConfig, out: Path, configs: list) -> None:
    """The line a user looks for at the end: what was trained and saved, or why not."""
    stats = dm.stats()
    tokens = int(stats.get("rows_in", 0))
    if steps == 0:
        log.warning(
            "no training step was made: %s tokens arrived%s (the first step waits for %s per "
            "stream, --warmup-tokens, or for the stream's end); nothing was saved",
            f"{tokens:,}",
            drops_text(stats, data_cfg.policy) if data_cfg.address else "",
            f"{data_cfg.warmup_tokens:,}",
        )
        return
    saved = [str(out / c.name) for c in configs if (out / c.name).is_dir()]
    log.info(
        "%d steps on %s tokens%s; saved: %s",
        steps,
        f"{tokens:,}",
        drops_text(stats, data_cfg.policy) if data_cfg.address else "",
        ", ".join(saved) or "nothing",
    )


def _bus_summary(stats: dict[str, float], policy: str) -> dict[str, Any]:
    """A live trainer's summary: its policy, and what the publisher dropped for it of
    what it had for it."""
    from trainers.data import bus_drops

    dropped, routed = bus_drops(stats)
    return {"policy": policy, "dropped": dropped, "routed": routed}


def drops_text(stats: dict[str, float], policy: str) -> str:
    """What the publisher dropped for this trainer and why, for its last line: "" when
    nothing was."""
    from trainers.data import bus_drops

    dropped, routed = bus_drops(stats)
    if not dropped:
        return ""
    of = f" of {routed:,}" if routed >= dropped else ""
    why = (
        " (the oldest waiting steps go when training falls behind, so generation never "
        "waits; --policy block trains on every step and makes generation wait)"
        if policy == "drop_oldest"
        else ""
    )
    return f"; the publisher dropped {dropped:,}{of} messages for it under --policy {policy}{why}"


def _parse(
    parser: argparse.ArgumentParser, argv: list[str] | None, build: Any
) -> tuple[argparse.Namespace, list[Any], DataConfig]:
    """Flags, then ``build(opts, subscriber options, d_in) -> (configs, data config)``; a
    bad value or an unreachable source ends the command with the parser's error, naming
    the flag."""
    opts = parser.parse_args(argv)
    show_own_logs()
    sub = SubscriberOptions.from_args(opts, parser)
    if (sub.connect is None) == (opts.run_dir is None):
        parser.error("give exactly one source: --connect ADDR (live) or --from DIR (a stored run)")
    if not 0.0 < opts.max_duty <= 1.0:
        parser.error(f"--max-duty: expected a share of time in (0, 1], got {opts.max_duty}")
    if opts.num_nodes < 1:
        parser.error(f"--num-nodes: expected 1 or more hosts, got {opts.num_nodes}")
    if opts.cpu_threads is not None and opts.cpu_threads < 1:
        parser.error(f"--cpu-threads: expected 1 or more threads, got {opts.cpu_threads}")
    _cpu_threads(opts.cpu_threads, opts.accelerator)
    if opts.num_nodes > 1 and "NODE_RANK" not in os.environ:
        parser.error(
            "--num-nodes: set NODE_RANK (this host's index), MASTER_ADDR and MASTER_PORT "
            "(rank 0's host and a free port) on every host"
        )
    from actbus.bus import SubscriptionRejected

    try:
        configs, data_cfg = build(opts, sub, _d_in(opts, sub))
        opts.push_target = _push_target(opts, configs)
    except SubscriptionRejected as e:
        # The publisher's refusal, not a bad flag: one line and status 1, as every
        # ``actbus run`` command ends on it (actbus/run.py, _fit_or_refused).
        print(f"{parser.prog}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ValueError, TimeoutError, FileNotFoundError) as e:
        parser.error(name_flag(parser, str(e), opts))
    return opts, configs, data_cfg


def _sae_configs(
    opts: argparse.Namespace, sub: SubscriberOptions, d_in: int
) -> tuple[list[SAEConfig], DataConfig]:
    return _models(SAEConfig, opts, sub, d_in), _data_cfg(opts, sub)


def _probe_configs(
    opts: argparse.Namespace, sub: SubscriberOptions, d_in: int
) -> tuple[list[ProbeConfig], DataConfig]:
    data_cfg = _data_cfg(
        opts,
        sub,
        label_tags=tuple(opts.labels),
        labelled_only=True,
        labels_file=opts.labels_file,
    )
    return _models(ProbeConfig, opts, sub, d_in), data_cfg


def _refused(e: BaseException) -> BaseException | None:
    """The publisher's refusal behind a failed fit (raised on the source's thread, then
    wrapped on the way up), or None."""
    from actbus.bus import SubscriptionRejected

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, SubscriptionRejected):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _fit_or_refused(kind: str, module, data_cfg: DataConfig, opts, configs: list) -> int:
    """Fit; a subscription the publisher refused (or cannot serve) ends the command
    with its reason, not a traceback."""
    try:
        summary = _fit(module, data_cfg, opts, configs)
    except Exception as e:
        why = _refused(e)
        if why is None:
            raise
        print(f"actbus run {kind}: {why}", file=sys.stderr)
        return 1
    return _push_verdict(kind, summary.get("push"), opts)


def _push_verdict(kind: str, push: dict[str, Any] | None, opts: argparse.Namespace) -> int:
    """1 when pushes were tried and none reached the engine (what --push is for did not
    happen, though the checkpoints were saved), with the line that says so; else 0."""
    if not push or push["sent"] or not (push["errors"] or push["dropped"]):
        return 0
    tried = len(push["errors"]) + push["dropped"]
    last = push["errors"][-1] if push["errors"] else "dropped: the engine did not keep up"
    print(
        f"actbus run {kind}: every push to {opts.push} failed ({tried} tried, none sent; "
        f"the last: {last}); the checkpoints under {opts.out} were saved",
        file=sys.stderr,
    )
    return 1


def sae_main(argv: list[str] | None = None) -> int:
    """train sparse autoencoders"""
    opts, configs, data_cfg = _parse(_sae_parser(), argv, _sae_configs)
    from trainers.sae_module import SAETrainer

    module = SAETrainer(configs, checkpoint_dir=opts.out, checkpoint_every=opts.checkpoint_every)
    return _fit_or_refused("sae", module, data_cfg, opts, configs)


def probe_main(argv: list[str] | None = None) -> int:
    """train linear probes on request-tag labels"""
    opts, configs, data_cfg = _parse(_probe_parser(), argv, _probe_configs)
    from trainers.probe import ProbeTrainer

    module = ProbeTrainer(configs, tuple(opts.labels), checkpoint_dir=opts.out)
    return _fit_or_refused("probe", module, data_cfg, opts, configs)


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("ACTBUS_LOG", "INFO"))
    sys.exit({"sae": sae_main, "probe": probe_main}[sys.argv[1]](sys.argv[2:]))
