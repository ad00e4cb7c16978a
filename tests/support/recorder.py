"""An in-process subscriber that keeps every row it receives, for engine tests.

Real sockets, real publisher; it only stores what arrives, indexed by request, so
tests can compare against the HF oracle and check each position came once.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from actbus.bus.fanin import subscribe
from actbus.bus.protocol import Subscription
from actbus.bus.subscriber import Batch, Source


@dataclass
class RequestRows:
    """The rows of one (request, sample, layer, hook), in arrival order."""

    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    acts: list[torch.Tensor] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    def sorted(self) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        order = np.argsort(self.positions, kind="stable")
        acts = torch.cat(self.acts) if self.acts else torch.zeros(0, 0)
        return (
            np.asarray(self.positions)[order],
            np.asarray(self.token_ids)[order],
            acts[torch.from_numpy(order)] if len(order) else acts,
        )


class RowRecorder:
    """Subscribe in a thread; ``rows[(request, sample, layer, hook)]`` fills up.

    ``address`` is a ``--connect`` spec: several publishers (data-parallel ranks) are
    read as one stream, and ``sources[(request, sample)]`` says which sent its rows."""

    def __init__(self, address: str, subscription: Subscription | None = None) -> None:
        self.sub = subscribe(address, subscription or Subscription(window=1024))
        self.sub.wait_welcome(60, every=True)
        self.rows: dict[tuple[str, int, int, str], RequestRows] = defaultdict(RequestRows)
        self.sources: dict[tuple[str, int], set[Source]] = defaultdict(set)
        self.tags: dict[tuple[str, int], dict] = {}
        self.ended: dict[tuple[str, int], str] = {}
        self.messages = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                out = self.sub.recv(timeout=0.2)
                if isinstance(out, Batch):
                    self._keep(out)
        except BaseException as e:  # surfaced by close()
            self.error = e

    def _keep(self, b: Batch) -> None:
        h, ri = b.header, b.header.rows
        with self._lock:
            self.messages += 1
            for e in h.ended:
                self.ended[(e.request_id, e.sample_index)] = e.reason
            for i, rid in enumerate(ri.request_ids):
                lo, hi = int(ri.offsets[i]), int(ri.offsets[i + 1])
                sidx = ri.request_sample_index(i)
                r = self.rows[(rid, sidx, h.layer, h.hook)]
                r.positions.extend(ri.positions[lo:hi].tolist())
                r.token_ids.extend(ri.token_ids[lo:hi].tolist())
                r.acts.append(b.tensor[lo:hi].clone())
                r.steps.extend([h.step] * (hi - lo))
                self.tags[(rid, sidx)] = ri.request_tags(i)
                self.sources[(rid, sidx)].add(b.source)

    def wait(self, predicate, timeout: float = 60.0, what: str = "rows") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self):
                    return
            if self.error:
                raise self.error
            time.sleep(0.05)
        raise TimeoutError(f"recorder: {what} did not arrive within {timeout}s")

    def wait_ended(self, keys, timeout: float = 60.0) -> None:
        keys = list(keys)
        self.wait(lambda c: all(k in c.ended for k in keys), timeout, f"ends of {keys[:3]}...")

    def get(self, rid: str, layer: int, hook: str, sample: int = 0):
        with self._lock:
            return self.rows[(rid, sample, layer, hook)].sorted()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sub.close()
        if self.error:
            raise self.error
