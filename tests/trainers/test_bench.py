"""benchmarks/bench_sae.py runs on CPU with small dims and ends with its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sae_runs_on_cpu():
    r = subprocess.run(
        [sys.executable, "benchmarks/bench_sae.py", "--device", "cpu", "--d", "64",
         "--expansion", "4", "--k", "8", "--tokens", "4096", "--batch-tokens", "512", "--bus"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["tokens_per_s"] > 0 and out["ratio_vs_baseline"] > 0
    assert set(out["paths"]) == {"baseline", "module", "lightning", "bus"}
    assert out["paths"]["bus"]["missed"] == 0
    assert out["paths"]["lightning"]["steps"] == 4096 // 512
    assert any(line.startswith("baseline ") for line in lines)  # the table
