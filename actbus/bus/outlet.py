"""What the capture worker publishes into: the interface, not a socket.

The first pipeline stage publishes into a ``Publisher``; every other stage into a
``StageForwarder`` that hands its messages to the first one. Both satisfy
``Outlet``, so the worker is written once against it.

Per step the worker asks ``admit`` which taps are worth copying (one ``TapOffer``
per tap, in the order it will publish them), then for each verdict either copies
and ``publish``es the rows, or calls ``drop`` (nothing copied; the drop is
counted and leaves a gap), or does nothing. ``count_step`` is called once per
engine step, captured or not. ``host_tensor`` gives the memory the rows' host copy
lands in, when the outlet has memory its local subscribers read directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from actbus.wire import Header


class Admission(Enum):
    """What the engine should do with one tap's rows this step (see ``Outlet.admit``)."""

    SEND = "send"  # copy the rows and ``publish`` them
    DROP = "drop"  # every subscriber that wants them would drop them: call ``drop``
    NONE = "none"  # no subscriber wants them: nothing to do


class TapOffer(NamedTuple):
    """One tap's rows offered for a step, before anything is copied."""

    layer: int
    hook: str
    nbytes: int
    """Bytes of the rows the message would carry."""
    for_return: bool
    """The message has rows of a request that asked for them back, or request ends
    (only then does the front end's return subscriber want it)."""


@runtime_checkable
class Outlet(Protocol):
    """Where captured messages go (a ``Publisher``, or a ``StageForwarder``)."""

    def admit(self, step: int, taps: Sequence[TapOffer]) -> list[Admission]:
        """One verdict per tap, in order; never waits."""
        ...

    def drop(self, header: Header) -> None:
        """Record a message ``admit`` said to drop (nothing was copied)."""
        ...

    def publish(self, header: Header, tensor: torch.Tensor, *, ready: Any = None) -> None:
        """Queue one message; ``ready`` (an event) completes before ``tensor`` is read."""
        ...

    def host_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Fresh host memory for a message's rows where local subscribers read them
        without a copy (the publisher's shared-memory region); None: ordinary memory."""
        ...

    def count_step(self, tokens: int, capture_s: float = 0.0) -> None:
        """The engine ran a step of ``tokens`` tokens, ``capture_s`` of it in actbus."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters, for the logs and the dashboards."""
        ...

    def close(self) -> None:
        """Send what is queued, then stop. Idempotent."""
        ...
