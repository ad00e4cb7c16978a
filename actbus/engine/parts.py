"""What actbus attached to one model runner: the features the step loop drives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actbus.capture.worker import CaptureWorker
    from actbus.hooks import HookRunner
    from actbus.monitor.graph import MonitorTables
    from actbus.steer.worker import Steerer
    from actbus.steps import StepRequests


@dataclass
class EngineParts:
    """What actbus attached to one model runner (``runner._actbus_parts``)."""

    capture: CaptureWorker | None = None
    """Publishes rows and runs the harvests (tensor-parallel rank 0 only)."""
    steer: Steerer | None = None
    """Fills this rank's steering tables (every rank)."""
    monitor_tables: MonitorTables | None = None
    """This rank's monitor tables, which pushes write (None: no monitors here)."""
    hooks: HookRunner | None = None
    """Runs requests' user hooks (every rank; None: the engine has no actbus.user_hooks)."""
    requests: StepRequests | None = None
    """The step in flight's requests, read before its forward for steering."""


NO_PARTS = EngineParts()


def parts_of(runner: Any) -> EngineParts:
    return getattr(runner, "_actbus_parts", None) or NO_PARTS
