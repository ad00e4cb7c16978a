"""Pipeline parallelism: every stage captures the layers it owns, one publisher.

Subscribers connect to one address and see one stream, so the first stage (its
tensor-parallel rank 0) binds the publisher and the other stages hand it their
messages over a local PUSH/PULL socket. A forwarded message enters the
publisher's queue as if captured there: same step numbers (every stage runs the
same scheduler outputs in the same order and counts steps alike), same
backpressure (when the queue is full the first stage stops reading, the socket's
high-water mark fills, and the forwarding stage waits like a local lossless
publish would). Per tap, messages still arrive in step order: each tap lives on
exactly one stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import zmq

from actbus.bus.outlet import Admission, TapOffer
from actbus.bus.publisher import Publisher
from actbus.wire import Header, WireError, frame_to_tensor, tensor_to_frame

log = logging.getLogger("actbus.capture")
HWM = 16  # messages buffered between stages before the forwarding stage waits
# A first stage that takes nothing for this long is gone: the message is dropped and
# counted (loudly), so a stage never hangs on a socket nobody reads.
SEND_TIMEOUT_S = 60.0


def stage_address(publish: str) -> str:
    """Where the first stage receives the other stages' messages (this host only)."""
    digest = hashlib.sha1(publish.encode()).hexdigest()[:16]
    return f"ipc://{Path(tempfile.gettempdir()) / f'actbus-stages-{digest}.sock'}"


class StageInbox:
    """First stage: feeds messages from the other stages into its publisher."""

    def __init__(self, publisher: Publisher, address: str) -> None:
        self.publisher = publisher
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="actbus-stages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            frames = self._sock.recv_multipart(copy=False)
            try:
                header = Header.decode(frames[0].buffer)
                tensor = frame_to_tensor(frames[1].buffer, header)
            except (WireError, IndexError) as e:
                log.error("actbus: bad message from another pipeline stage: %s", e)
                continue
            self.publisher.publish(header, tensor)  # waits while the queue is full

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()


class StageForwarder:
    """Another stage's ``Outlet``: what the capture worker publishes into, forwarding
    every message to the first stage. It cannot see subscribers, so it admits every
    tap; the first stage's publisher applies each subscriber's policy."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.connect(address)
        self.dropped = 0
        self._items: queue.Queue[tuple[Header, torch.Tensor, Any] | None] = queue.Queue(HWM)
        self._thread = threading.Thread(target=self._run, name="actbus-forward", daemon=True)
        self._thread.start()

    def admit(self, step: int, taps: Sequence[TapOffer]) -> list[Admission]:
        return [Admission.SEND] * len(taps)

    def count_step(self, tokens: int, capture_s: float = 0.0) -> None:
        """Every stage runs the same tokens: the first stage counts them (and its own
        capture time)."""
        pass

    def host_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return None  # the rows go to the first stage over a socket

    def drop(self, header: Header) -> None:  # never asked: admit sends everything
        raise AssertionError("a forwarding stage does not drop")

    def publish(self, header: Header, tensor: torch.Tensor, *, ready: Any = None) -> None:
        self._items.put((header, tensor.contiguous(), ready))  # waits when the link is full

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            header, tensor, ready = item
            if ready is not None:
                ready.synchronize()
            try:
                self._sock.send_multipart([header.encode(), tensor_to_frame(tensor)], copy=False)
            except zmq.Again:
                self.dropped += 1
                log.error(
                    "actbus: the first pipeline stage took nothing for %.0f s; dropped step %d "
                    "layer %d %s (%d dropped so far)",
                    SEND_TIMEOUT_S, header.step, header.layer, header.hook, self.dropped,
                )  # fmt: skip

    def stats(self) -> dict[str, Any]:
        return {"forwarding": True, "dropped": self.dropped}

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._items.put(None, timeout=5)
            self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()
