"""A publisher of synthetic activations with a planted sparse dictionary (trainer tests).

python -m tests.trainer_synth ADDR MESSAGES [--rows R] [--requests Q] [--seed S]
    [--label-shift D] [--layers 0,3] [--nonfinite-every N] [--id-prefix P]
    [--huge-every N] [--bad-labels-at S] [--wide-at S]

Each message is one step of ``--requests`` fake requests of ``rows/requests`` rows:
every row is a sum of ``ACTIVE`` of ``ATOMS`` unit atoms in ``D`` dims with weights in
[0.5, 1.5], plus noise. Each request carries a tag ``label`` (0/1); with
``--label-shift D`` its rows are moved by ``(2*label - 1) * D`` along a planted unit
direction, so the label is linear in the activations. With ``--nonfinite-every N``
every N-th message has a NaN in its first row and an infinity in its second. Hostile
streams (issue 33): ``--huge-every N``: every N-th message (the first included) has two
rows near +-3e38, finite in float32; ``--bad-labels-at S``: at step S three requests'
labels are 1e308, 3.5e38 and "1e39" (finite in float64, not in float32); ``--wide-at S``:
step S's rows are 8 wider than the rest.
Prints "ready" once bound, publishes MESSAGES steps (waiting for the first
subscriber), then closes (END).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from actbus.bus import Publisher
from actbus.wire import Header, RowIndex

ROOT = Path(__file__).resolve().parents[2]
D, ATOMS, ACTIVE, NOISE = 64, 512, 4, 0.01
ATOM_SEED = 1234  # not the SAE's init seed: a planted atom must not equal an initial row


class SynthPublisher:
    def __init__(self, address: str, messages: int, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.support.trainer_synth", address, str(messages), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        )
        assert self.p.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)


def planted(seed: int = ATOM_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The planted atoms ``[ATOMS, D]`` and the label direction ``[D]``."""
    g = torch.Generator().manual_seed(seed)
    atoms = torch.nn.functional.normalize(torch.randn(ATOMS, D, generator=g), dim=1)
    direction = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    return atoms, direction


def sample(n: int, g: torch.Generator, atoms: torch.Tensor) -> torch.Tensor:
    idx = torch.rand(n, ATOMS, generator=g).topk(ACTIVE, dim=1).indices
    coef = torch.rand(n, ACTIVE, generator=g) + 0.5
    return (coef.unsqueeze(-1) * atoms[idx]).sum(1) + NOISE * torch.randn(n, D, generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("messages", type=int)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label-shift", type=float, default=0.0)
    p.add_argument("--layers", default="0")
    p.add_argument("--wait-subscribers", type=int, default=1)
    p.add_argument("--nonfinite-every", type=int, default=0)
    p.add_argument("--id-prefix", default="", help="before each request id (fan-in tests)")
    p.add_argument("--huge-every", type=int, default=0)
    p.add_argument("--bad-labels-at", type=int, default=-1)
    p.add_argument("--wide-at", type=int, default=-1)
    a = p.parse_args()
    atoms, direction = planted()
    g = torch.Generator().manual_seed(a.seed)
    layers = [int(v) for v in a.layers.split(",")]
    pub = Publisher(
        a.address,
        info={"model": "synthetic", "hidden_size": D},
        heartbeat_s=0.2,
        queue_bytes=4 << 20,
    )
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while len(pub.stats()["subscribers"]) < a.wait_subscribers and time.monotonic() < deadline:
        time.sleep(0.05)
    per = a.rows // a.requests
    offsets = np.arange(a.requests + 1, dtype=np.int64) * per
    for step in range(a.messages):
        labels = torch.randint(0, 2, (a.requests,), generator=g)
        x = sample(per * a.requests, g, atoms)
        if a.label_shift:
            shift = (2 * labels.float() - 1).repeat_interleave(per) * a.label_shift
            x = x + shift[:, None] * direction
        if a.nonfinite_every and step % a.nonfinite_every == a.nonfinite_every - 1:
            x[0, 3], x[1, 0] = float("nan"), float("inf")
        if a.huge_every and step % a.huge_every == 0:
            x[0], x[1] = 3e38, -3.3e38
        if step == a.wide_at:
            x = torch.cat([x, torch.zeros(len(x), 8)], dim=1)
        tags: list[dict] = [{"label": int(v)} for v in labels]
        if step == a.bad_labels_at:
            tags[0], tags[1], tags[2] = {"label": 1e308}, {"label": 3.5e38}, {"label": "1e39"}
        ids = [f"{a.id_prefix}s{step}-r{i}" for i in range(a.requests)]
        ri = RowIndex(
            ids,
            offsets,
            np.tile(np.arange(per, dtype=np.int64), a.requests),
            np.zeros(per * a.requests, dtype=np.int64),
            tags=tags,
        )
        for layer in layers:
            hdr = Header(step, layer, "post_block", "float32", tuple(x.shape), "synthetic", ri)
            pub.publish(hdr, x)
    pub.close(timeout=30)
    print("done", flush=True)


if __name__ == "__main__":
    main()
