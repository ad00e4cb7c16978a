"""The capture worker: after each engine step, turn tap buffers into messages.

It lives in the vLLM worker process (tensor-parallel rank 0 only: the residual
stream is replicated across TP ranks). Runner adapters call ``on_step`` with a
``StepView`` built from the runner's own batch, so rows map to requests exactly
as the model saw them under continuous batching and chunked prefill.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass

import numpy as np
import torch

from actbus.bus.publisher import Publisher
from actbus.capture.requests import caller_request_id
from actbus.capture.taps import TapSet
from actbus.config import CaptureConfig
from actbus.wire import DTYPE_NAMES, Header, RowIndex

log = logging.getLogger("actbus.capture")


@dataclass
class StepView:
    """One forward step's batch, as the runner laid it out."""

    req_ids: list[str]  # vLLM-internal ids, batch order
    offsets: np.ndarray  # [num_reqs + 1] row offsets per request
    positions: torch.Tensor  # [num_tokens] (any device)
    token_ids: torch.Tensor  # [num_tokens] (any device)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


class CaptureWorker:
    """Owns the taps and the publisher for one engine."""

    def __init__(
        self,
        cfg: CaptureConfig,
        taps: TapSet,
        model_name: str,
        engine: dict[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.taps = taps
        self.model_name = model_name
        self.step = 0
        self._side = None  # CUDA side stream for device-to-host copies, made on first use
        layers = sorted({k[0] for k in taps.keys})
        hooks = sorted({k[1] for k in taps.keys})
        self.publisher = Publisher(
            cfg.publish,
            info={
                "model": model_name,
                "hidden_size": taps.hidden_size,
                "dtype": DTYPE_NAMES[taps.dtype],
                "layers": layers,
                "hooks": hooks,
                "engine": engine or {},
            },
            queue_bytes=cfg.queue_mb << 20,
            heartbeat_s=cfg.heartbeat_s,
            subscriber_timeout_s=cfg.subscriber_timeout_s,
        )
        atexit.register(self.close)
        log.info(
            "actbus: capturing layers %s hooks %s, publishing on %s", layers, hooks, cfg.publish
        )

    def on_step(self, view: StepView) -> None:
        n = view.num_tokens
        if n == 0:
            return
        if n > self.taps.max_rows:
            raise RuntimeError(
                f"actbus: step has {n} tokens but tap buffers hold {self.taps.max_rows}"
            )
        ids = torch.stack((view.positions[:n], view.token_ids[:n].to(view.positions.dtype)))
        if ids.is_cuda:
            ids_host, acts, ready = self._to_host_async(
                ids, [b[:n] for b in self.taps.buffers.values()]
            )
            acts = dict(zip(self.taps.buffers, acts, strict=True))
        else:
            ids_host = ids
            acts = {key: buf[:n].clone() for key, buf in self.taps.buffers.items()}
            ready = None
        rows = RowIndex(
            request_ids=[caller_request_id(r) for r in view.req_ids],
            offsets=np.asarray(view.offsets, dtype=np.int64),
            positions=ids_host[0].numpy(),
            token_ids=ids_host[1].numpy(),
        )
        dtype = DTYPE_NAMES[self.taps.dtype]
        for (layer, hook), act in acts.items():
            header = Header(
                step=self.step,
                layer=layer,
                hook=hook,
                dtype=dtype,
                shape=(n, self.taps.hidden_size),
                model=self.model_name,
                rows=rows,
            )
            self.publisher.publish(header, act, ready=ready)
        self.step += 1

    def _to_host_async(self, ids: torch.Tensor, taps: list[torch.Tensor]):
        """Host copies that neither stall the engine nor slow its next step.

        A device-side copy on the compute stream (fast) frees the tap buffers for the
        next forward in stream order; the device-to-host copy into pinned memory then
        runs on a side stream, overlapping the next step. ``ids`` is already a fresh
        tensor and needs no such copy. Returns the host tensors and an event the
        publisher thread waits on before reading them.
        """
        main = torch.cuda.current_stream()
        staged = [ids, *(t.clone() for t in taps)]
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(main)
        hosts = []
        with torch.cuda.stream(self._side):
            for t in staged:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(self._side)  # keep the staging memory until copied
                hosts.append(h)
            ready = torch.cuda.Event()
            ready.record(self._side)
        return hosts[0], hosts[1:], ready

    def close(self) -> None:
        self.publisher.close()
