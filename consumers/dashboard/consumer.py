"""The web dashboard's consumer: a ``DashboardSampler`` whose reports go to a ``Board``."""

from __future__ import annotations

from typing import Any

from consumers.dashboard.board import Board
from consumers.sampler import DashboardSampler


class WebDashboard(DashboardSampler):
    name = "dashboard"

    def __init__(self, address: str, board: Board, **kw: Any) -> None:
        super().__init__(address, recent=board.recent, **kw)
        self.board = board

    @classmethod
    def from_args(cls, args: Any) -> WebDashboard:
        raise TypeError("the web dashboard runs with `actbus dashboard`, not `actbus run`")

    def digest(self) -> None:
        with self.board.lock:  # the server reads recent requests from another thread
            super().digest()

    def report(self, snap: dict[str, Any]) -> None:
        self.board.publish(snap)
