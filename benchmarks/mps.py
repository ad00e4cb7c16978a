"""NVIDIA's Multi-Process Service around a benchmark: engine and trainer share the GPU's
SMs instead of taking turns.

Without MPS, processes on one GPU time-slice it: while the trainer holds a slice the
engine's kernels wait, and each switch costs both. Under MPS their kernels run side by
side. On an H200 (``bench_journey_rounds.py``, one engine, ``benchmarks/RESULTS.md``)
the journey's SAE training on every token cost generation 21% time-sliced and 14% under
MPS. A user starts the same daemon (``nvidia-cuda-mps-control -d``) before vLLM and the
trainers (``docs/gpu.md``); this module does it for one benchmark run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


@contextmanager
def mps_daemon(work: Path) -> Iterator[dict[str, str]]:
    """Start an MPS control daemon private to ``work``, yield the environment its
    clients need (every process on the GPU: engine and consumers alike), stop it."""
    binary = shutil.which(CONTROL)
    if binary is None:
        raise SystemExit(f"--mps: {CONTROL} is not on PATH (it comes with NVIDIA's driver)")
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(work / "mps-pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(work / "mps-log"),
    }
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    full = {**os.environ, **env}
    r = subprocess.run([binary, "-d"], env=full, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise SystemExit(f"--mps: {CONTROL} -d failed ({r.returncode}): {r.stderr.strip()}")
    try:
        yield env
    finally:
        subprocess.run([binary], input="quit\n", env=full, capture_output=True, text=True,
                       timeout=30)  # fmt: skip
