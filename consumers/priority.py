"""How a dashboard yields the CPU to the engine it watches (no heavy imports: the
flags are read by ``actbus --help``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

log = logging.getLogger("actbus.priority")

DEFAULT_NICE = 10
SCHEDS = ("idle", "other")


def lower_priority(nice: int, sched: str = "idle") -> int:
    """Yield the CPU to the engine on the same host: this process's threads (and those
    it starts later) run at niceness ``nice`` or lower priority and, with ``sched``
    "idle", in Linux's SCHED_IDLE class: only on CPU time no other thread wants, so a
    CPU engine that keeps every core busy is never preempted by a dashboard (which then
    falls behind and loses sampled steps, counted, instead). Never raises the priority.
    Returns the niceness now in effect."""
    idle = sched == "idle" and hasattr(os, "SCHED_IDLE")
    if sched == "idle" and not idle:
        log.info("SCHED_IDLE is Linux-only: running at niceness %d instead", nice)
    # On Linux both calls act on one thread: every thread alive now is set (imports
    # start some, such as the BLAS pool); threads started later inherit.
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError):  # a thread may end meanwhile
            if nice > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, min(nice, 19))
            if idle:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    return os.getpriority(os.PRIO_PROCESS, 0)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [0]


def add_priority_arguments(parser: argparse.ArgumentParser) -> None:
    """``--sched`` and ``--nice``, shared by the dashboards."""
    parser.add_argument(
        "--sched",
        choices=SCHEDS,
        default="idle",
        help="CPU scheduling: idle (default; Linux SCHED_IDLE: runs only on CPU time the "
        "engine leaves free) or other (the normal scheduler at --nice)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=DEFAULT_NICE,
        help=f"CPU niceness (default {DEFAULT_NICE}): the engine on the same host gets the "
        "CPU first",
    )
