"""Live pushes from a trainer into a serving engine's monitor or live steering vector
(``--push ADDR``).

Every ``every`` optimizer steps the callback snapshots the model being trained (a
probe or an SAE, copied to the CPU on the training thread: small, and the weights
must not change under the copy) and queues it. A sender thread writes the snapshot
in the checkpoint format (``save_probe`` / ``save_sae``), folds it with the engine's
own loader (``actbus.monitor.weights.load_weights``: the same folded direction and
bias a checkpoint-loaded monitor gets) and pushes it over the engine's control
endpoint (``actbus.bus.control``). A push into a live steering vector
(``--push-vector``) reads the snapshot back with the engine's vector loader instead
(``actbus.steer.vectors.load_source``): the probe head's unit direction, or the SAE
latent's unit decoder row, the values ``{"probe": DIR}`` / ``{"sae": DIR, "feature":
K}`` would register. Training never waits for the engine: the queue
holds ``queue`` snapshots and a full queue drops the new one, counted and logged; the
engine's refusals are logged and kept in ``errors``.
"""

from __future__ import annotations

import copy
import logging
import queue
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from actbus.monitor.config import MonitorDef
from actbus.monitor.weights import load_weights

log = logging.getLogger("actbus.trainers.push")


@dataclass(frozen=True)
class PushTarget:
    """Which trained model goes to which of the engine's monitors or live vectors."""

    name: str
    """The engine's monitor (``actbus.monitor.monitors``) or live steering vector
    (``actbus.steer.live``)."""
    model: str
    """The trained model's name (``--name``; a probe or SAE config's ``name``)."""
    kind: str  # "probe" | "sae"
    head: str | None = None
    """Probe: the label whose head is pushed (default: the only one)."""
    features: tuple[int, ...] = ()
    """SAE: the latents the monitor scores, in the monitor's order; for a live vector,
    the one latent whose decoder row is pushed."""
    into: str = "monitor"
    """``monitor``, or ``vector``: a live steering vector."""


@dataclass
class PushStats:
    sent: int = 0
    dropped: int = 0
    versions: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class PushWeights(pl.Callback):
    """Push ``target``'s current weights to the engine every ``every`` steps and at
    the end of training."""

    def __init__(
        self,
        address: str,
        target: PushTarget,
        every: int,
        *,
        server_key: str | None = None,
        client_secret_key: str | None = None,
        queue_size: int = 2,
        timeout_s: float = 10.0,
    ) -> None:
        if every < 1:
            raise ValueError(f"--push-every: expected a number of steps >= 1, got {every}")
        from actbus.bus.control import ControlClient

        self.target = target
        self.every = every
        self.stats = PushStats()
        self._client = ControlClient(
            address,
            server_key=server_key,
            client_secret_key=client_secret_key,
            timeout_s=timeout_s,
        )
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._send_loop, name="actbus-push", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training side
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step and step % self.every == 0:
            self._offer(pl_module, step)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and trainer.global_step:
            self._offer(pl_module, trainer.global_step, block=True)
        self.close()

    def _offer(self, module, step: int, block: bool = False) -> None:
        t = self.target
        model = module.probe(t.model) if t.kind == "probe" else module.sae(t.model)
        if not bool(getattr(model, "initialized", True)):
            return
        snap = copy.deepcopy(model).cpu()
        try:
            self._queue.put((step, snap), block=block, timeout=30 if block else None)
        except queue.Full:
            self.stats.dropped += 1
            log.warning(
                "actbus: push of %s at step %d dropped: %d pushes still waiting for the "
                "engine (dropped so far: %d)",
                t.name, step, self._queue.qsize(), self.stats.dropped,
            )  # fmt: skip

    # -------------------------------------------------------------- sender side
    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, snap = item
            try:
                reply = self._push(snap)
            except Exception as e:  # the engine refused it, or is unreachable
                self.stats.errors.append(str(e))
                log.error("actbus: push of %s at step %d failed: %s", self.target.name, step, e)
                continue
            self.stats.sent += 1
            self.stats.versions.append(int(reply["version"]))
            log.info(
                "actbus: pushed %s at step %d: version %d",
                self.target.name, step, reply["version"],
            )  # fmt: skip

    def _push(self, snap) -> dict[str, Any]:
        if self.target.into == "vector":
            return self._client.push_vector(self.target.name, direction(snap, self.target))
        mw = folded(snap, self.target)
        theta = mw.theta if mw.activation == "jumprelu" else None
        return self._client.push(self.target.name, mw.weight, mw.bias, theta)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        self._client.close()


def folded(model, target: PushTarget):
    """The ``MonitorWeights`` an engine loads from ``model``'s checkpoint: written and
    read back with the same code, so a push and a checkpoint score alike."""
    from trainers.checkpoint import save_probe, save_sae

    with tempfile.TemporaryDirectory(prefix="actbus-push-") as tmp:
        path = Path(tmp) / "ckpt"
        if target.kind == "probe":
            save_probe(model, path)
            d = MonitorDef(target.name, "probe", (0,), path=str(path), head=target.head)
        else:
            save_sae(model, path)
            d = MonitorDef(
                target.name, "sae", (0,), path=str(path), features=tuple(target.features)
            )
        return load_weights(d, int(model.cfg.d_in), f"--push {target.name}")


def direction(model, target: PushTarget):
    """The unit vector the engine loads from ``model``'s checkpoint as a named vector
    (a probe head's direction, an SAE latent's decoder row): written and read back with
    the same code, so a pushed live vector equals the registered checkpoint's."""
    from actbus.steer.config import VectorSource
    from actbus.steer.vectors import load_source
    from trainers.checkpoint import save_probe, save_sae

    with tempfile.TemporaryDirectory(prefix="actbus-push-") as tmp:
        path = Path(tmp) / "ckpt"
        if target.kind == "probe":
            save_probe(model, path)
            src = VectorSource("probe", str(path), head=target.head)
        else:
            save_sae(model, path)
            src = VectorSource("sae", str(path), feature=target.features[0])
        return load_source(src, f"--push-vector {target.name}")
