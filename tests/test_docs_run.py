"""Docs blocks that need no engine, run as pasted in a directory of their own, and what
each wrote checked. The blocks that need a server run in ``tests/test_journeys.py``;
``tests/support/docs_blocks.py`` says how blocks are marked.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.support.docs_blocks import block


def _run(block_id: str, cwd: Path, epilogue: str = "") -> str:
    """The block in bash (``-e``: a failing command fails it), with the suite's venv
    active (the README's first line); its output."""
    venv = Path(sys.executable).parent.parent
    script = f". {venv}/bin/activate\n{block(block_id).code}{epilogue}"
    r = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_security_keys(tmp_path):
    """docs/security.md's keys: the publisher's pair, a subscriber "client" and one more,
    "rank1", each secret 0600 and the publisher's authorized keys naming both."""
    _run("security-keys", tmp_path)
    keys = tmp_path / "keys"
    for secret in ("server.key_secret", "client.key_secret", "rank1.key_secret"):
        assert stat.S_IMODE((keys / secret).stat().st_mode) == 0o600, secret
    assert (keys / "server.key").is_file()
    assert sorted(p.name for p in (keys / "authorized_keys").iterdir()) == [
        "client.key",
        "rank1.key",
    ]


def test_moe_tiny_model(tmp_path):
    """docs/moe.md's line builds (or finds in the cache) a tiny Qwen3-MoE model, as the
    page says: four layers, four experts, two per token."""
    out = _run("moe-tiny-model", tmp_path, epilogue='echo "$MODEL"\n')
    config = json.loads((Path(out.strip().splitlines()[-1]) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"], config["architectures"]
    shape = [config[k] for k in ("num_hidden_layers", "num_local_experts", "num_experts_per_tok")]
    assert shape == [4, 4, 2], shape
