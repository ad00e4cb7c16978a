"""Region blocks still viewed by subscribers the publisher no longer serves.

A subscriber on the region path reads its rows through views of the publisher's
blocks, and the publisher holds each block for it until it acknowledges the message
(``Route.reading``). When the publisher stops serving a subscriber (timed out, not
reading, disconnected, left) it cannot tell that the views are gone: a paused process
resumes and reads on. So those blocks are retired here, never recycled under it,
until either

- the subscriber's process is known gone: its pidfd (opened when it subscribed, so
  a reused pid is never mistaken for it) becomes readable when it exits, and its
  mappings, with every view, go with it; or
- the same subscriber says, in its next HELLO or its BYE, which of them it still
  views (``viewing``): the others are released at once, those stay until it exits.

What retiring costs is bounded: the blocks are the region's (a full region sends on
the socket, counted in ``shm_fallback``), and at most ``MAX_RETIRED`` subscribers'
blocks are kept (past that, new subscribers on this host read from the socket).
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch

from actbus.wire import WireError

MAX_RETIRED = 1024
"""Subscribers whose blocks may be retired at once (each keeps one pidfd open)."""
MAX_PID = 1 << 22
"""Linux's largest pid_max: a HELLO's pid is checked against it."""


def open_pidfd(pid: int) -> int | None:
    """A pidfd of the live process ``pid`` (None: gone, or pidfds are not supported:
    Linux before 5.3). It refers to that process only, whatever reuses its pid."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


@dataclass
class _Retiree:
    ident: bytes
    pidfd: int
    blocks: dict[int, torch.Tensor]  # seq -> the block its rows lie in
    settled: bool = False  # its subscriber said what it still views: kept until it exits


class Retired:
    """Blocks of departed subscribers, released only once their views are known gone."""

    def __init__(self) -> None:
        self._retirees: list[_Retiree] = []
        self.retired = 0  # blocks retired, ever
        self.released = 0  # of those, released (their subscriber said so, or exited)

    def __len__(self) -> int:
        return len(self._retirees)

    @property
    def full(self) -> bool:
        return len(self._retirees) >= MAX_RETIRED

    @property
    def held(self) -> int:
        """Blocks retired and not yet released."""
        return self.retired - self.released

    def retire(self, ident: bytes, pidfd: int, blocks: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Keep ``blocks`` until the process behind ``pidfd`` exits or the subscriber
        ``ident`` says it no longer views them; takes ownership of ``pidfd``."""
        kept = dict(blocks)
        if not kept:
            os.close(pidfd)
            return
        self.retired += len(kept)
        self._retirees.append(_Retiree(ident, pidfd, kept))

    def settle(self, ident: bytes, viewing: Collection[int] | None) -> None:
        """Subscriber ``ident`` (subscribing again) still views the messages ``viewing``
        of those it was sent before (None: it does not say: all are kept). The rest
        are released; the kept ones stay until its process exits."""
        for r in self._retirees:
            if r.ident != ident or r.settled:
                continue
            r.settled = True  # its numbering starts afresh: later seqs are not these
            if viewing is None:
                continue
            gone = [seq for seq in r.blocks if seq not in viewing]
            for seq in gone:
                del r.blocks[seq]
            self.released += len(gone)
        self._drop_empty()

    def poll(self) -> int:
        """Release the blocks of every subscriber whose process has exited; how many."""
        if not self._retirees:
            return 0
        p = select.poll()
        for r in self._retirees:
            p.register(r.pidfd, select.POLLIN)
        exited = {fd for fd, _ in p.poll(0)}
        n = 0
        for r in self._retirees:
            if r.pidfd in exited:
                n += len(r.blocks)
                r.blocks.clear()
        self.released += n
        self._drop_empty()
        return n

    def close(self) -> None:
        """The publisher stops: its region goes with the last mapping anyway."""
        for r in self._retirees:
            with contextlib.suppress(OSError):
                os.close(r.pidfd)
        self._retirees.clear()

    def _drop_empty(self) -> None:
        keep = []
        for r in self._retirees:
            if r.blocks:
                keep.append(r)
            else:
                os.close(r.pidfd)
        self._retirees = keep


def parse_viewing(value: object, most: int) -> frozenset[int] | None:
    """A HELLO's or BYE's ``viewing``: the seqs of messages whose rows the subscriber
    still views (None: it does not say, and all its blocks are kept). At most ``most``
    of them (``WireError`` otherwise: a subscriber holding more says None)."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > most
        or not all(type(s) is int and 0 <= s < 1 << 64 for s in value)
    ):
        raise WireError(f"viewing must be null or a list of at most {most} seqs (ints >= 0)")
    return frozenset(value)


def parse_pid(facts: object) -> int | None:
    """The subscriber's pid from a HELLO's ``shm`` facts (None: absent or not a pid)."""
    pid = facts.get("pid") if isinstance(facts, dict) else None
    return pid if type(pid) is int and 0 < pid <= MAX_PID else None
