"""The W&B consumer, offline, against a real publisher with synthetic activations
whose statistics are known; its run is read back from W&B's own transaction log."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest
import torch

from actbus.bus import Publisher
from actbus.cli import consumer_command
from actbus.wire import Header, RowIndex
from consumers.wandb_offline import CorruptLog, find_runs, history, records, run_info
from tests.support.dashboard_procs import start_wandb, wandb_env
from tests.support.procs import ROOT, wait_for

HIDDEN = 64
ROWS = 6
SCALE = {0: 1.0, 3: 4.0}  # per layer: rows are N(0, SCALE^2), so norm ~ SCALE * sqrt(HIDDEN)
EVERY = 5


def synthetic(step: int, layer: int, gen: torch.Generator) -> tuple[Header, torch.Tensor]:
    ri = RowIndex(
        ["req-a", "req-b"],
        np.array([0, 4, ROWS]),
        np.arange(ROWS),
        np.arange(ROWS) + 100,
        tags=[{"split": "train"}, {"split": "eval"}],
    )
    x = torch.randn(ROWS, HIDDEN, generator=gen) * SCALE[layer]
    x[:, 3] = 50.0 * SCALE[layer]  # one outlier dimension in 64
    return Header(step, layer, "post_block", "float32", (ROWS, HIDDEN), "synthetic", ri), x


def test_wandb_run_holds_bus_and_activation_metrics(tmp_path):
    address = f"ipc://{tmp_path}/bus.sock"
    pub = Publisher(address, info={"model": "synthetic"}, heartbeat_s=0.1)
    proc = start_wandb(
        address,
        tmp_path,
        "--policy",
        f"sample:{EVERY}",
        "--interval",
        "0.5",
        "--project",
        "actbus-test",
        "--wandb-group",
        "capture-42",
        "--exit-on-end",
    )
    try:
        wait_for(
            lambda: "wandb" in pub.stats()["subscribers"] or proc.poll() is not None,
            90,
            "the W&B consumer to subscribe",
        )
        assert proc.poll() is None, (tmp_path / "wandb-consumer.log").read_text()
        gen = torch.Generator().manual_seed(0)
        steps = 303
        for step in range(steps):
            for layer in SCALE:
                pub.publish(*synthetic(step, layer, gen))
            time.sleep(0.005)  # about 150 steps/s: a pace a sampling consumer keeps up with
        mine = wait_for(
            lambda: (s := pub.stats()["subscribers"].get("wandb")) and not s["inflight"] and s,
            30,
            "the consumer to acknowledge everything",
        )
        published = pub.stats()["published"]
        time.sleep(1.2)  # at least two more reports with the publisher still up
    finally:
        pub.close()
        rc = proc.wait(timeout=60) if proc.poll() is None else proc.returncode
    assert rc == 0, (tmp_path / "wandb-consumer.log").read_text()

    [path] = find_runs(tmp_path)
    info = run_info(path)
    assert (info["project"], info["group"], info["job_type"]) == (
        "actbus-test",
        "capture-42",
        "bus",
    )
    rows = history(path)
    assert len(rows) >= 3, rows
    last = rows[-1]
    sampled = len([s for s in range(steps) if s % EVERY == 0])
    # Steps counted are exactly the steps published that the sample policy takes.
    assert last["sampled/steps_counted"] == sampled
    assert last["sampled/received"] == 2 * sampled == mine["sent"]
    assert last["sampled/dropped"] == 0 and mine["dropped"] == {}
    assert mine["sampled_out"] == 2 * (steps - sampled)
    assert last["sampled/sample_every"] == EVERY
    # Bus health, from the publisher's counters (the last row with them: the final
    # one is written after the publisher ended, without them).
    bus = [r for r in rows if "bus/published" in r]
    assert bus and max(r["bus/published"] for r in bus) == published == 2 * steps
    assert max(r["bus/last_step"] for r in bus) == steps - 1
    assert max(r["bus/steps_per_s"] for r in bus) > 20
    assert max(r["bus/bytes_per_s"] for r in bus) > 0
    assert "bus/lag_steps/wandb" in bus[-1]
    # Activations: norms of N(0, s^2) rows of 64 dims plus one dimension at 50 s.
    for layer, s in SCALE.items():
        base = f"acts/L{layer}.post_block"
        expect = s * np.sqrt(HIDDEN - 1 + 50.0**2)
        assert last[f"{base}/norm_mean"] == pytest.approx(expect, rel=0.05)
        assert last[f"{base}/rows"] == ROWS * sampled
        assert last[f"{base}/outlier_frac"] == pytest.approx(1 / HIDDEN)
        assert abs(last[f"{base}/mean_drift"]) < 0.2  # same distribution throughout
        assert abs(last[f"{base}/var_drift"]) < 0.3
        assert last[f"{base}/norm_hist/_type"] == "histogram"
        assert sum(last[f"{base}/norm_hist/values"]) > 0
        bins = last[f"{base}/norm_hist/bins"]
        assert bins[0] < expect < bins[-1]
        # Per tag: req-a (train) has 4 rows a step, req-b (eval) 2.
        assert last[f"tags/split=train/L{layer}.post_block/rows"] == 4 * sampled
        assert last[f"tags/split=eval/L{layer}.post_block/rows"] == 2 * sampled


def _written(path) -> bool:
    """Whether the log holds its exit record. wandb-core's writer can still be writing
    when ``run.finish()`` returns: in fresh-clone runs of the suite the file read back
    without its history row once, without its run record the next time, and whole a
    minute later."""
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except CorruptLog:  # a chunk half written
        return False


def test_offline_reader_refuses_a_corrupt_log(tmp_path):
    import wandb

    run = wandb.init(
        project="p", dir=tmp_path, mode="offline", settings=wandb.Settings(silent=True)
    )
    run.log({"x": 1.5})
    run.finish()
    [path] = find_runs(tmp_path)
    wait_for(lambda: _written(path), 30, "the log's exit record")
    assert run_info(path)["project"] == "p"
    assert [r["x"] for r in history(path)] == [1.5]
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLog, match="checksum mismatch at offset"):
        list(records(path))
    path.write_bytes(b"not a log")
    with pytest.raises(CorruptLog, match="not a W&B log"):
        list(records(path))


def test_wandb_flags_are_checked_by_name(tmp_path):
    out = subprocess.run(
        consumer_command("wandb", f"ipc://{tmp_path}/x.sock", "--interval", "0"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=wandb_env(tmp_path),
    )
    assert out.returncode == 1
    assert "--interval: must be > 0 seconds" in out.stderr


def test_wandb_without_credentials_logs_offline_and_says_so(tmp_path):
    """No API key, no .netrc, no WANDB_MODE: the consumer logs offline and says so, as
    the trainers do (was: wandb's UsageError, a traceback, exit 1)."""
    address = f"ipc://{tmp_path}/bus.sock"
    unset = ("WANDB_MODE", "WANDB_API_KEY", "NETRC")
    env = {k: v for k, v in wandb_env(tmp_path).items() if k not in unset}
    env["HOME"] = str(tmp_path)  # no ~/.netrc here
    pub = Publisher(address, info={"model": "synthetic"}, heartbeat_s=0.1)
    log = tmp_path / "wandb-consumer.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            consumer_command(
                "wandb", address, "--wandb-dir", str(tmp_path), "--interval", "0.3",
                "--exit-on-end",
            ),
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )  # fmt: skip
        try:
            wait_for(
                lambda: "wandb" in pub.stats()["subscribers"] or proc.poll() is not None,
                90,
                "the W&B consumer to subscribe",
            )
            gen = torch.Generator().manual_seed(0)
            for step in range(20):
                pub.publish(*synthetic(step, 0, gen))
            time.sleep(1.0)
        finally:
            pub.close()
            rc = proc.wait(timeout=60) if proc.poll() is None else proc.returncode
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "no W&B credentials" in text and "logging offline" in text, text[-3000:]
    [path] = find_runs(tmp_path)
    assert "offline-run-" in str(path) and history(path)
