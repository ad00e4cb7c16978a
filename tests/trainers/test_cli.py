"""``actbus run sae|probe`` as a user runs them: from a live publisher, from a stored run,
and under DDP (2 CPU processes, one load-balanced subscriber per rank)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from actbus.bus import Batch, Publisher
from actbus.wire import Header, RowIndex
from consumers.fs.sink import FsSink
from tests.support.procs import free_port, start_sink, stop, wait_for
from tests.support.trainer_synth import SynthPublisher
from trainers.checkpoint import load_sae

ROOT = Path(__file__).resolve().parents[2]


def _run(kind: str, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "actbus.cli", "run", kind, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ddp_two_ranks_train_each_token_once(tmp_path):
    """Each rank subscribes in one load-balancing group: the tokens they trained on are
    disjoint and together are every token published (block policy: none dropped)."""
    address = f"ipc://{tmp_path}/synth.sock"
    messages = 60
    pub = SynthPublisher(address, messages, "--rows", "256", "--wait-subscribers", "2")
    ledger = tmp_path / "ledger"
    try:
        r = _run(
            "sae", "--connect", address, "--d-in", "64", "--layer", "0", "--k", "4",
            "--expansion", "4", "--policy", "block", "--batch-tokens", "256",
            "--buffer-tokens", "2048", "--warmup-tokens", "512", "--idle-s", "10",
            "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
            "--out", str(tmp_path / "out"), "--no-progress", "--ledger", str(ledger),
            "--summary", str(tmp_path / "summary.json"),
        )  # fmt: skip
    finally:
        pub.stop()
    assert r.returncode == 0, r.stderr[-4000:]
    seen = _tokens_per_rank(ledger)
    for rank, tokens in enumerate(seen):
        assert tokens, f"rank {rank} got nothing: not load-balanced"
    ids = [f"s{s}-r{i}" for s in range(messages) for i in range(8)]
    expected = {(r, str(p)) for r in ids for p in range(32)}
    assert seen[0] | seen[1] == expected
    print(f"\nrank 0: {len(seen[0])} tokens, rank 1: {len(seen[1])} tokens")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] > 0
    load_sae(next(p for p in (tmp_path / "out").iterdir() if (p / "cfg.json").exists()))


def test_ddp_two_ranks_share_two_publishers_each_token_once(tmp_path):
    """Fan-in: two publishers into a 2-rank DDP trainer, one group at each publisher:
    the ranks' tokens are disjoint and together every token of both publishers."""
    addrs = [f"ipc://{tmp_path}/synth-{i}.sock" for i in range(2)]
    messages = 30
    pubs = [
        SynthPublisher(
            a, messages, "--rows", "256", "--wait-subscribers", "2", "--id-prefix", f"p{i}"
        )
        for i, a in enumerate(addrs)
    ]
    ledger = tmp_path / "ledger"
    try:
        r = _run(
            "sae", "--connect", ",".join(addrs), "--d-in", "64", "--layer", "0", "--k", "4",
            "--expansion", "4", "--policy", "block", "--batch-tokens", "256",
            "--buffer-tokens", "2048", "--warmup-tokens", "512", "--idle-s", "10",
            "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
            "--out", str(tmp_path / "out"), "--no-progress", "--ledger", str(ledger),
            "--summary", str(tmp_path / "summary.json"),
        )  # fmt: skip
    finally:
        for p in pubs:
            p.stop()
    assert r.returncode == 0, r.stderr[-4000:]
    seen = _tokens_per_rank(ledger)
    for rank, tokens in enumerate(seen):
        assert {rid[:2] for rid, _ in tokens} == {"p0", "p1"}, f"rank {rank}: not both"
    ids = [f"p{k}s{s}-r{i}" for k in range(2) for s in range(messages) for i in range(8)]
    assert seen[0] | seen[1] == {(r, str(p)) for r in ids for p in range(32)}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["data"]["bus/pub0/received"] > 0 and summary["data"]["bus/pub1/received"] > 0


def test_two_nodes_one_rank_each_train_each_token_once(tmp_path):
    """``--num-nodes 2``: two hosts' trainers (here two processes, each its own node with
    NODE_RANK, MASTER_ADDR and MASTER_PORT as a cluster sets them) form one DDP group and
    one load-balancing group at the publisher: each token trained once across nodes."""
    address = f"ipc://{tmp_path}/synth.sock"
    messages = 40
    pub = SynthPublisher(address, messages, "--rows", "256", "--wait-subscribers", "2")
    ledger = tmp_path / "ledger"
    flags = [
        "sae", "--connect", address, "--d-in", "64", "--layer", "0", "--k", "4",
        "--expansion", "4", "--policy", "block", "--batch-tokens", "256",
        "--buffer-tokens", "2048", "--warmup-tokens", "512", "--idle-s", "10",
        "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2", "--strategy", "ddp",
        "--out", str(tmp_path / "out"), "--no-progress", "--ledger", str(ledger),
    ]  # fmt: skip
    port = free_port()
    nodes = []
    try:
        for node in (0, 1):
            env = {
                **os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
                "OMP_NUM_THREADS": "1", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }  # fmt: skip
            nodes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "actbus.cli", "run", *flags],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
        pub.stop()
    for node, (n, out) in enumerate(zip(nodes, outs, strict=True)):
        assert n.returncode == 0, f"node {node}: {out[-4000:]}"
    seen = _tokens_per_rank(ledger)
    for rank, tokens in enumerate(seen):
        assert tokens, f"rank {rank} got nothing: not load-balanced"
    ids = [f"s{s}-r{i}" for s in range(messages) for i in range(8)]
    assert seen[0] | seen[1] == {(r, str(p)) for r in ids for p in range(32)}


def test_num_nodes_without_the_cluster_env_is_refused_by_name(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NODE_RANK"}
    r = subprocess.run(
        [sys.executable, "-m", "actbus.cli", "run", "sae", "--connect", "ipc:///nonexistent",
         "--d-in", "64", "--layer", "0", "--num-nodes", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--num-nodes: set NODE_RANK" in r.stderr


def _tokens_per_rank(ledger: Path) -> list[set[tuple[str, ...]]]:
    """Each rank's trained (request id, position) pairs from its ledger; no token twice
    within a rank, none shared between the two ranks."""
    seen = []
    for rank in (0, 1):
        lines = Path(f"{ledger}.rank{rank}").read_text().splitlines()
        seen.append({tuple(line.split("\t")[1:]) for line in lines})
        assert len(lines) == len(seen[-1]), f"rank {rank} trained a token twice"
    assert not seen[0] & seen[1]
    return seen


def test_sae_and_probe_from_a_stored_run(tmp_path):
    """Publisher -> fs sink process -> run dir; then ``--from DIR`` trains from it, with
    probe labels from the tags the sink kept."""
    address = f"ipc://{tmp_path}/bus.sock"
    run_dir = tmp_path / "run"
    pub = Publisher(address, info={"model": "synthetic", "hidden_size": 64}, heartbeat_s=0.2)
    sink = start_sink(address, run_dir, "--exit-on-end")
    g = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(64, generator=g), dim=0)
    try:
        wait_for(lambda: pub.stats()["subscribers"], 30, "the sink to subscribe")
        for step in range(40):
            labels = torch.randint(0, 2, (8,), generator=g)
            x = torch.randn(256, 64, generator=g) * 0.3
            x += ((2 * labels.float() - 1).repeat_interleave(32))[:, None] * direction
            ri = RowIndex(
                [f"q{step}-{i}" for i in range(8)],
                np.arange(9, dtype=np.int64) * 32,
                np.tile(np.arange(32), 8),
                np.zeros(256, dtype=np.int64),
                tags=[{"label": int(v)} for v in labels],
            )
            pub.publish(Header(step, 2, "post_block", "float32", (256, 64), "synthetic", ri), x)
        pub.close(timeout=30)
        assert sink.wait(timeout=60) == 0
    finally:
        stop(sink)
    common = ["--from", str(run_dir), "--layer", "2", "--batch-tokens", "256", "--epochs", "1"]
    common += ["--buffer-tokens", "2048", "--warmup-tokens", "512", "--no-progress"]
    r = _run("sae", *common, "--k", "8", "--expansion", "2", "--out", str(tmp_path / "sae"),
             "--summary", str(tmp_path / "sae.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((tmp_path / "sae.json").read_text())
    assert s["data"]["tokens/L2.post_block"] == 40 * 256  # every stored row, once
    (ckpt,) = [p for p in (tmp_path / "sae").iterdir() if (p / "cfg.json").exists()]
    assert load_sae(ckpt).cfg.layer == 2
    meta = json.loads((ckpt / "cfg.json").read_text())["metadata"]  # from the run's manifest
    assert meta["model_name"] == "synthetic" and meta["dataset_path"] == str(run_dir)
    assert meta["context_size"] == 32

    # --max-duty: the trainer rests after each step, spending at most that share of its
    # time in steps (uncapped it is busy nearly all the time), and trains on the same rows.
    # --cpu-threads sizes torch's CPU pool (on a CPU-only host it is left alone unless asked).
    r = _run("sae", *common, "--k", "8", "--expansion", "2", "--out", str(tmp_path / "capped"),
             "--max-duty", "0.25", "--summary", str(tmp_path / "capped.json"),
             "--cpu-threads", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    capped = json.loads((tmp_path / "capped.json").read_text())
    assert capped["cpu_threads"] == 1
    assert capped["data"]["tokens/L2.post_block"] == 40 * 256
    assert capped["duty"] <= 0.26 < 0.5 < s["duty"], (capped["duty"], s["duty"])

    r = _run("probe", *common, "--label", "label", "--lr", "0.05", "--out",
             str(tmp_path / "probe"), "--summary", str(tmp_path / "probe.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    p = json.loads((tmp_path / "probe.json").read_text())
    acc = [v for k, v in p["metrics"].items() if k.endswith("heldout_accuracy")]
    print(f"\nprobe from the stored run: {p['metrics']}")
    assert acc and acc[0] >= 0.95
    (saved,) = (tmp_path / "probe").glob("*/probe.safetensors")
    assert load_file(str(saved))["linear.weight"].shape == (1, 64)
    # Saved when the fit ended: with the final held-out metrics the summary reports.
    meta = json.loads((saved.parent / "probe.json").read_text())
    kept = meta["metrics"]
    # What the stream told, as an SAE's checkpoint keeps it (was {} for probes).
    assert meta["source"]["model"] == "synthetic" and meta["source"]["hidden_size"] == 64
    assert meta["source"]["dataset_path"] == str(run_dir) and meta["source"]["context_size"] == 32
    assert kept == {k: v for k, v in p["metrics"].items() if k.startswith(saved.parent.name + "/")}
    assert any(k.endswith("heldout_accuracy") for k in kept)


# Runs ``actbus.cli.main`` (what ``python -m actbus.cli`` exits with) on each argv in
# turn, in one process: one interpreter start and one import of the trainers for all.
_MANY = """
import contextlib, io, json, sys
from actbus.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception as e:  # a flag let through: name the case, not a traceback
            code = f"raised {e!r}"
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def _run_many(*argvs: tuple[str, ...]) -> list[tuple[int, str]]:
    """(exit status, stderr) of ``actbus ARGV...`` for each argv."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", _MANY, json.dumps([list(a) for a in argvs])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [(code, err) for code, err in json.loads(r.stdout.splitlines()[-1])]


def test_bad_flags_are_named():
    r = _run("sae", "--layer", "0")  # once as a user runs it: the real exit status
    assert r.returncode == 2 and "--connect ADDR" in r.stderr
    live = ("run", "sae", "--connect", "ipc:///tmp/x", "--d-in", "8", "--layer", "0")
    sae = (*live, "--k", "2", "--expansion", "2", "--push", "ipc:///tmp/c", "--push-vector", "v")
    cases = {
        ("run", "sae", "--from", "/nonexistent", "--layer", "0"): "/nonexistent",
        (*live, "--k", "999", "--expansion", "2"): "k: expected 1..d_sae (16)",
        (*live, "--k", "2", "--policy", "sometimes"): "sometimes",
        (*live, "--k", "2", "--max-duty", "0"): "--max-duty: expected a share of time in (0, 1]",
        (*live, "--k", "2", "--cpu-threads", "0"): "--cpu-threads: expected 1 or more threads",
        (*sae, "--push-features", "1,2"): "--push-features: with --push-vector give the one",
        (*sae, "--push-features", "16"): "latent 16 is out of range; the SAE has 16",
        (*sae, "--push-features", "1", "--push-monitor", "m"): "drop --push-monitor",
        # Named as typed: --layer and --hook, not their other spellings --layers, --hooks[0].
        (*live[:-1], "-1", "--k", "2"): "error: --layer: expected a 0-based layer index",
        (*live, "--k", "2", "--hook", "post_blok"): "error: --hook: unknown hook 'post_blok'",
        (*live, "--k", "2", "--hooks", "post_block,pre_atn"): "error: --hooks[1]: unknown hook",
        # relu has no k: two values of it would be two models of one name
        (*live, "--kind", "relu", "--k", "2,4"): "two models would be saved as 'L0.post_block",
    }
    for (argv, want), (code, err) in zip(cases.items(), _run_many(*cases), strict=True):
        assert code == 2 and want in err, (argv, code, err[-2000:])


def test_several_saes_from_one_subscription(tmp_path):
    """--layer 0,3 --k 4,8: four SAEs (2 layers x 2 k) fed by one subscriber, every
    token of both layers trained on by the two SAEs of its layer."""
    address = f"ipc://{tmp_path}/synth.sock"
    messages = 40
    pub = SynthPublisher(address, messages, "--rows", "256", "--layers", "0,3")
    try:
        r = _run(
            "sae", "--connect", address, "--d-in", "64", "--layer", "0,3", "--k", "4,8",
            "--expansion", "2", "--policy", "block", "--batch-tokens", "256",
            "--buffer-tokens", "2048", "--warmup-tokens", "512", "--idle-s", "5",
            "--out", str(tmp_path / "out"), "--no-progress",
            "--summary", str(tmp_path / "summary.json"),
        )  # fmt: skip
    finally:
        pub.stop()
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["data"]["bus/received"] == 2 * messages  # one subscriber got both layers
    for layer in (0, 3):
        assert s["data"][f"tokens/L{layer}.post_block"] == messages * 256
    saved = sorted(p.name for p in (tmp_path / "out").iterdir() if (p / "cfg.json").exists())
    assert saved == [
        "L0.post_block-topk-k4-x2",
        "L0.post_block-topk-k8-x2",
        "L3.post_block-topk-k4-x2",
        "L3.post_block-topk-k8-x2",
    ]
    assert load_sae(tmp_path / "out" / saved[3]).cfg.layer == 3
    assert set(s["fvu_history"]) == set(saved)


def _stored_run(path: Path, steps: int = 20) -> None:
    """A run of ``steps`` steps of 8 requests x 32 rows at layer 2, tagged split=train
    (even requests) or eval; row values are random."""
    sink = FsSink(str(path))
    sink.on_welcome({"model": "synthetic", "hidden_size": 64, "dtype": "float32"})
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        ri = RowIndex(
            [f"q{step}-{i}" for i in range(8)],
            np.arange(9, dtype=np.int64) * 32,
            np.tile(np.arange(32), 8),
            np.zeros(256, dtype=np.int64),
            tags=[{"split": "train" if i % 2 == 0 else "eval"} for i in range(8)],
        )
        h = Header(step, 2, "post_block", "float32", (256, 64), "synthetic", ri)
        sink.on_batch(Batch(header=h, tensor=torch.randn(256, 64, generator=g), seq=step))
    sink.close()


def test_from_a_stored_run_match_filters_and_passes_make_useful_steps(tmp_path):
    """``--from RUN --match split=train`` trains on the train requests only, as a live
    ``--match`` would (it was ignored with --from); without ``--epochs`` it makes about
    200 steps and says how many passes that is (one pass made 5 steps of a small run)."""
    run_dir, ledger = tmp_path / "run", tmp_path / "ledger"
    _stored_run(run_dir)  # 5,120 rows, 2,560 of them train
    r = _run(
        "sae", "--from", str(run_dir), "--layer", "2", "--match", "split=train",
        "--batch-tokens", "256", "--buffer-tokens", "2048", "--warmup-tokens", "512",
        "--k", "4", "--expansion", "2", "--no-progress", "--out", str(tmp_path / "sae"),
        "--ledger", str(ledger),
        "--summary", str(tmp_path / "sae.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "2,560 rows per stream matching --match; 20 passes over them (chosen for about 200 " in (
        r.stderr
    ), r.stderr[-3000:]
    trained = [line.split("\t")[1] for line in Path(f"{ledger}.rank0").read_text().splitlines()]
    assert len(trained) == 20 * 2560
    assert {int(rid.split("-")[1]) % 2 for rid in trained} == {0}  # train requests only
    assert 190 <= json.loads((tmp_path / "sae.json").read_text())["steps"] <= 210
    assert "steps on 51,200 tokens; saved: " in r.stderr


def test_a_trainer_stopped_during_warm_up_trains_on_what_it_has_and_saves(tmp_path):
    """The warm-up shows its progress; SIGTERM (as Ctrl-C) before it is done trains on
    the buffered tokens and saves a checkpoint (it was: 0 steps, nothing saved, and
    Lightning's own SIGTERM handling skipped the end of the fit)."""
    address = f"ipc://{tmp_path}/bus.sock"
    info = {"model": "synthetic", "hidden_size": 64, "layers": [0], "hooks": ["post_block"]}
    pub = Publisher(address, info=info, heartbeat_s=0.2)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "run", "sae", "--connect", address, "--layer", "0",
         "--warmup-tokens", "60000", "--batch-tokens", "256", "--k", "4", "--expansion", "2",
         "--no-progress", "--out", str(tmp_path / "sae"), "--summary", str(tmp_path / "s.json")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: "sae" in pub.stats()["subscribers"], 120, "the trainer to subscribe")
        g = torch.Generator().manual_seed(0)
        for step in range(20):  # 1,280 tokens: far from the warm-up's 60,000
            ri = RowIndex([f"r{step}"], np.array([0, 64]), np.arange(64), np.zeros(64))
            h = Header(step, 0, "post_block", "float32", (64, 64), "synthetic", ri)
            pub.publish(h, torch.randn(64, 64, generator=g))
        wait_for(lambda: any("warming up: L0.post_block 1,280 of" in x for x in lines), 30,
                 "the warm-up's progress")  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close(timeout=1)
        reader.join(timeout=10)
    out = "".join(lines)
    assert rc == 0, out[-4000:]
    assert "the 60,000 tokens per stream the first step waits for (--warmup-tokens)" in out
    assert "stopping: no more data is read; training on what is buffered" in out, out[-3000:]
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 5
    (ckpt,) = [p for p in (tmp_path / "sae").iterdir() if (p / "cfg.json").exists()]
    assert load_sae(ckpt).cfg.layer == 0 and "5 steps on 1,280 tokens; saved: " in out


def test_a_trainer_says_whom_it_waits_for_whom_it_joined_and_what_it_missed(tmp_path):
    """Before the publisher is up, the trainer's waiting line names the layer asked for
    (it said "the publisher's counters (no layers)"); once it subscribes, one line names
    the publisher, layers and policy; at the end, its last line and summary say what
    the publisher dropped for it under ``drop_oldest`` (those drops showed only in W&B)."""
    address = f"ipc://{tmp_path}/bus.sock"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "run", "sae", "--connect", address, "--layer", "0",
         "--window", "2", "--warmup-tokens", "1024", "--buffer-tokens", "1024",
         "--batch-tokens", "256", "--k", "4",
         "--expansion", "2", "--no-progress", "--out", str(tmp_path / "sae"),
         "--summary", str(tmp_path / "s.json")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    pub = None
    try:
        waiting = "still waiting, to subscribe to layers [0], hooks ['post_block'] (policy "
        wait_for(lambda: any(waiting in x for x in lines), 120, "the waiting line")
        info = {"model": "synthetic", "hidden_size": 64, "layers": [0], "hooks": ["post_block"]}
        pub = Publisher(address, info=info, heartbeat_s=0.2)
        wait_for(lambda: "sae" in pub.stats()["subscribers"], 60, "the trainer to subscribe")
        proc.send_signal(signal.SIGSTOP)  # a trainer that falls behind, for certain
        g = torch.Generator().manual_seed(0)
        for step in range(200):  # its window, 2, and 8 waiting are kept: 190 evicted
            ri = RowIndex([f"r{step}"], np.array([0, 64]), np.arange(64), np.zeros(64))
            h = Header(step, 0, "post_block", "float32", (64, 64), "synthetic", ri)
            pub.publish(h, torch.randn(64, 64, generator=g))
        wait_for(lambda: pub.stats()["queued"] == 0, 30, "routing")
        dropped = pub.stats()["subscribers"]["sae"]["dropped"]
        proc.send_signal(signal.SIGCONT)
        pub.close(timeout=10)  # END: the trainer trains on what it holds and saves
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pub is not None:
            pub.close(timeout=1)
        reader.join(timeout=10)
    out = "".join(lines)
    assert rc == 0, out[-4000:]
    n = sum(dropped.values())
    assert n == 190, dropped
    assert f"subscribed to the publisher at {address} (model 'synthetic', run " in out
    assert "layers [0], hooks ['post_block'] (policy drop_oldest, as sae)" in out, out[-3000:]
    assert f"; the publisher dropped {n:,} of 200 messages for it under --policy drop_oldest (" in (
        out
    ), out[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["policy"], summary["dropped"], summary["routed"]) == ("drop_oldest", n, 200)
    assert out.count("warmed up: the first step starts") == 1, out[-3000:]  # issue 50


def test_a_trainer_whose_every_push_failed_exits_non_zero(tmp_path):
    """--push to an engine's control endpoint that refuses every push (it has no monitor
    of that name): the fit ends and saves as always, but the command says that no push
    reached the engine and exits 1 (it exited 0)."""
    from actbus.bus.control import ControlConfig, ControlServer
    from actbus.bus.pushwire import Slot

    run_dir = tmp_path / "run"
    _stored_run(run_dir, steps=4)
    control = f"ipc://{tmp_path}/control.sock"
    endpoint = ControlServer(ControlConfig(control), {"p": Slot(1, 64, "sigmoid")}, {"p": 1})
    try:
        r = _run(
            "sae", "--from", str(run_dir), "--layer", "2", "--epochs", "1",
            "--batch-tokens", "256", "--buffer-tokens", "1024", "--warmup-tokens", "256",
            "--k", "4", "--expansion", "2", "--no-progress", "--out", str(tmp_path / "sae"),
            "--push", control, "--push-monitor", "m", "--push-features", "0",
            "--summary", str(tmp_path / "sae.json"),
        )  # fmt: skip
    finally:
        endpoint.close()
    assert r.returncode == 1, r.stderr[-4000:]
    push = json.loads((tmp_path / "sae.json").read_text())["push"]
    assert push["sent"] == 0 and len(push["errors"]) >= 1, push
    assert endpoint.refused >= 1 and endpoint.accepted == 0
    assert f"actbus run sae: every push to {control} failed (" in r.stderr, r.stderr[-3000:]
    assert "no monitor named 'm'" in r.stderr
    assert any(p.is_dir() for p in (tmp_path / "sae").iterdir())  # saved all the same
