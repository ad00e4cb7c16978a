"""benchmarks/bench_dataplane.py runs on CPU (``--device cpu``: small sizes) and ends
with its JSON line: every data-path arm, each with positive figures. Its two engine arms
(plain and all layers) are ``bench_capture``'s, started the same way; they are left out
here, where each tiny engine start costs about 50 s of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_dataplane import ARMS  # noqa: E402

PIECES = [a for a in ARMS if a not in ("plain", "all_layers")]


def test_bench_dataplane_runs_every_piece_on_cpu():
    r = subprocess.run(
        [sys.executable, "benchmarks/bench_dataplane.py", "--device", "cpu",
         "--arm-timeout", "400", "--configs", ",".join(PIECES)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert not [k for k in out if k.startswith("timed_out_")], out
    assert set(out["arms"]) == set(PIECES)
    for name, arm in out["arms"].items():
        assert arm["tok_per_s"] > 0 and arm["ratio"] > 0, name
        assert arm["gb_per_s"] > 0 and arm["engine_ms_per_step"] >= 0, name
    for kind in ("prefill", "decode"):  # lossless: the subscriber got every row
        sub = out["arms"][f"null_{kind}"]["subscriber"]
        assert sub["rows"] > 0 and sub["bytes"] > 0
        assert out["arms"][f"shm_{kind}"]["shm"]["blocks"] > 0  # the copies went to the region
    assert any(line.startswith("d2h_prefill ") for line in lines)  # the table
