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

    def __init__(self, cfg: CaptureConfig, taps: TapSet, model_name: str) -> None:
        self.cfg = cfg
        self.taps = taps
        self.model_name = model_name
        self.step = 0
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
        rows = RowIndex(
            request_ids=[caller_request_id(r) for r in view.req_ids],
            offsets=np.asarray(view.offsets, dtype=np.int64),
            positions=view.positions[:n].to("cpu", torch.int64).numpy(),
            token_ids=view.token_ids[:n].to("cpu", torch.int64).numpy(),
        )
        dtype = DTYPE_NAMES[self.taps.dtype]
        hidden = self.taps.hidden_size
        for (layer, hook), buf in self.taps.buffers.items():
            # A copy: the buffer is overwritten by the next step while this is queued.
            act = buf[:n].to("cpu", copy=True)
            header = Header(
                step=self.step,
                layer=layer,
                hook=hook,
                dtype=dtype,
                shape=(n, hidden),
                model=self.model_name,
                rows=rows,
            )
            self.publisher.publish(header, act)
        self.step += 1

    def close(self) -> None:
        self.publisher.close()
