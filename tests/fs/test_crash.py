"""Crash safety of fs-sink: kill -9 at random moments, a full disk.

Real ``actbus run fs-sink`` processes fed by a real publisher (a thread of this
process publishing synthetic steps); files on a real file system.
"""

from __future__ import annotations

import random
import re
import subprocess
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from actbus.cli import consumer_command
from consumers.fs import ActivationRun, layout
from tests.support.fs_procs import log_of, publisher, sink, step_message, wait_exit
from tests.support.procs import ROOT, manifest, start_sink, wait_for


class Feeder:
    """Publishes a new step every ``period`` s until stopped; steps never repeat."""

    def __init__(self, pub, period: float, hidden: int = 64) -> None:
        self.pub = pub
        self.period = period
        self.hidden = hidden
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.step
            reqs = [(f"r{s // 5}", 0, 4 * (s % 5), {}), (f"q{s // 3}", 0, 4 * (s % 3), {})]
            self.pub.publish(*step_message(s, reqs, hidden=self.hidden))
            self.step += 1
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _check_after_kill(out: Path, seen: dict[str, str]) -> int:
    """Listed shards match the manifest; at most one complete unlisted shard (killed
    between its rename and the manifest update); committed shards never change."""
    if manifest(out) is None:
        return 0
    run = ActivationRun(out)
    problems = run.verify()
    unlisted = [p for p in problems if p.endswith("on disk, not in the manifest")]
    assert problems == unlisted, problems
    assert len(unlisted) <= 1, unlisted
    for p in unlisted:  # complete: the whole file reads back
        layout.read_shard(out / p.split(":")[0], run.ipc)
    for s in run.manifest["shards"]:
        assert seen.setdefault(s["path"], s["checksum"]) == s["checksum"], s["path"]
    assert set(seen) <= {s["path"] for s in run.manifest["shards"]} | {
        p.split(":")[0] for p in unlisted
    }
    return len(unlisted)


KILLS = 12


def test_kill_9_at_random_moments_12_times_then_restart_continues(tmp_path):
    rng = random.Random(20)
    out = tmp_path / "run"
    pub = publisher(f"ipc://{tmp_path}/bus.sock")
    feeder = Feeder(pub, period=0.004)
    seen: dict[str, str] = {}
    unlisted_seen = 0
    max_index = -1
    t0 = time.monotonic()
    try:
        for i in range(KILLS):
            before = (manifest(out) or {}).get("sessions", 0)
            proc = start_sink(pub.address, out, "--shard-rows", "48", "--flush-s", "0.2")
            if i % 4 == 3:  # now and then at any moment, start-up included
                time.sleep(rng.uniform(0.0, 2.0))
            else:  # mostly while it writes: shards are committed every few ms
                wait_for(
                    lambda b=before, p=proc: (
                        (manifest(out) or {}).get("sessions", 0) > b or p.poll()
                    ),
                    60,
                    "the sink to subscribe",
                    interval=0.02,
                )
                time.sleep(rng.uniform(0.05, 0.6))
            proc.kill()
            proc.wait(timeout=10)
            assert proc.returncode == -9, log_of(out)
            unlisted_seen += _check_after_kill(out, seen)
            m = manifest(out)
            if m and m["shards"]:
                idx = max(layout.shard_index(Path(s["path"]).name) for s in m["shards"])
                assert idx >= max_index  # new shards are numbered after the old ones
                max_index = idx
        loop_s = time.monotonic() - t0
        # a restart continues the run: adopts any unlisted shard, adds new ones
        shards_before = len(seen)
        final = sink(pub.address, out, "--shard-rows", "48", "--flush-s", "0.2")
        wait_for(
            lambda: len((manifest(out) or {}).get("shards", [])) > shards_before + 2,
            30,
            "new shards after the restart",
        )
    finally:
        feeder.stop()
        pub.close()
    assert wait_exit(final, out) == 0, log_of(out)
    run = ActivationRun(out)
    assert run.verify() == []
    for path, digest in seen.items():  # nothing committed was rewritten
        assert next(s for s in run.manifest["shards"] if s["path"] == path)["checksum"] == digest
    table = run.dataset().to_table(columns=["step", "request_id", "position"])
    keys = pc.binary_join_element_wise(
        pc.cast(table.column("step"), pa.string()),
        table.column("request_id"),
        pc.cast(table.column("position"), pa.string()),
        ":",
    )
    assert pc.count_distinct(keys).as_py() == table.num_rows  # no row stored twice
    # 3 of the kills may come before the sink subscribed; the restart is one more
    assert run.manifest["sessions"] >= KILLS - 3 + 1 and table.num_rows > 1000
    assert not list(out.rglob("*.tmp"))
    print(
        f"kill loop: {loop_s:.1f}s, {len(seen)} shards, {unlisted_seen} unlisted after a kill, "
        f"{run.manifest['sessions']} sessions, {table.num_rows} rows"
    )


def _small_fs(path: Path) -> bool:
    """A 1 MiB tmpfs at ``path``; False when mounting is not allowed here."""
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


def test_disk_full_stops_cleanly_and_keeps_committed_shards(tmp_path):
    mnt = tmp_path / "mnt"
    mounted = _small_fs(mnt)
    out = mnt / "run"
    pub = publisher(f"ipc://{tmp_path}/bus.sock", hidden=1024)
    try:
        if mounted:
            proc = sink(pub.address, out, "--shard-rows", "32")
        else:  # no mount allowed: a size-limited sink process (RLIMIT_FSIZE, EFBIG)
            argv = consumer_command("fs-sink", pub.address, "--out", str(out), "--shard-rows", "32")
            out.mkdir(parents=True)
            proc = subprocess.Popen(
                ["prlimit", "--fsize=200000", "--", *argv],
                cwd=ROOT,
                stdout=open(mnt / "run.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
            wait_for(lambda: manifest(out), 60, "the sink to subscribe")
        step = 0
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            pub.publish(*step_message(step, [("r", 0, 4 * step, {}), ("s", 0, 0, {})], hidden=1024))
            step += 1
            time.sleep(0.01)
        rc = wait_exit(proc, out, timeout=20)
        log = log_of(out)
        assert rc == 1, log
        why = "No space left on device" if mounted else "File too large"
        assert f"--out {out}: cannot write" in log and why in log, log[-3000:]
        assert "are complete and intact" in log
        # the loss is counted and said (0 when only the manifest did not fit)
        assert re.search(r"\d+ rows received were not stored", log), log[-3000:]
        run = ActivationRun(out)
        problems = run.verify()
        # the manifest itself may be what did not fit: then the last shard is unlisted
        assert all(p.endswith("on disk, not in the manifest") for p in problems), problems
        assert len(problems) <= 1 and len(run.shards()) >= 3
        assert not list(out.rglob("*.tmp"))  # the half-written shard was removed
        n = run.dataset().count_rows()
        assert n == run.manifest["total_rows"] >= 3 * 32
    finally:
        pub.close()
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("flag", [["--reduce", "nope"], ["--positions", "5"]])
def test_bad_flags_are_named(tmp_path, flag):
    r = subprocess.run(
        consumer_command("fs-sink", f"ipc://{tmp_path}/x.sock", "--out", str(tmp_path), *flag),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and flag[0] in r.stderr, r.stderr
