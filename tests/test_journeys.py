"""The README's journeys, run as their scripts in ``examples/`` are run, on CPU with
the tiny Llama, and what each made checked: checkpoints that load, rows stored and
replayed, W&B runs with metrics, the dashboard's view, activations returned with the
right shapes, the closed loop's scores against HF transformers. Then the README's
blocks, as pasted (``tests/support/docs_blocks.py`` says how): serve and train, steer
over HTTP, store and replay, and its Python steering snippet run as a file; and
docs/http.md's Inspect block, whose server is its own (its monitor is the probe the
README's serve block trained).

The engines: one ``actbus serve`` that journeys 1 (serve and train) and 2 (store and
replay), the closed loop and the README's shell blocks drive as a running server
(``--connect/--url``), the Inspect block's server, journey 3's own offline ``LLM``, and
the README snippet's.
Journey 1 runs last of the server's journeys and ends with Ctrl-C of that server
(``--until-end``): its trainers save on the END ``actbus serve`` sends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from actbus.streams import point_key
from tests.support.engine import IN_PROCESS
from tests.support.procs import free_port, wait_for, wait_healthy

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
LAYERS = (1, 3)


def _script(
    name: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **(env or {}),
    }
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(r.stdout[-3000:])
    return r


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory) -> Path:
    """Where the README's blocks run, as one shell session, and the server runs."""
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, readme_dir):
    """``actbus serve`` as the README starts it (tiny Llama, layers 1 and 3), in the
    directory the README's blocks run in (paths they send it are relative to it)."""
    tmp = tmp_path_factory.mktemp("journey-server")
    run = tempfile.mkdtemp(prefix="actbus-jt-")
    address, control = f"ipc://{run}/bus.sock", f"ipc://{run}/control.sock"
    port = free_port()
    log = open(tmp / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "actbus.cli", "serve", str(tiny_models["llama"]),
         "--layers", "1,3", "--publish", address, "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "512", "--gpu-memory-utilization", "0.3",
         # The journeys' logic is under test, not the compiled graph (the session engines
         # capture, steer and score with torch.compile on): eager starts in half the time.
         "--enforce-eager",
         "--actbus-config", json.dumps(
             _loop_config(tiny_models["llama"], control, tmp_path_factory.getbasetemp())
         )],
        stdout=log, stderr=subprocess.STDOUT, cwd=readme_dir,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, tmp / "server.log", 600)
        yield address, url, control, proc, tmp / "server.log"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _loop_config(model_path: Path, control: str, vectors: Path) -> dict:
    """What the closed loop needs of the server (``examples/closed_loop.py`` starts its
    own with the same): a sigmoid monitor at layer 1 to push the probe into, the
    control endpoint, steering at layer 2 (and 1 and 3, for the README's blocks), and
    the tests' directory (where the loop's --out and the README's runs are) to register
    checkpoints from over HTTP."""
    hidden = json.loads((model_path / "config.json").read_text())["hidden_size"]
    probe = {"weight": [0.0] * hidden, "sigmoid": True, "layers": [1]}
    return {
        "monitor": {"monitors": {"probe": probe}},
        "control": control,
        # Layer 2 for the closed loop; 1 and 3, as the README's steering examples.
        "steer": {"layers": [1, 2, 3], "hooks": ["post_block"], "vector_dirs": [str(vectors)]},
    }


def test_store_train_from_disk_and_replay(server, tmp_path):
    """Journey 2 against the server: the run holds every row fed at both layers, intact;
    the SAE trained from disk on label=1 requests loads; the replayed copy is the same."""
    from consumers.fs import ActivationRun
    from trainers.checkpoint import load_sae

    address, url, *_ = server
    out = tmp_path / "store"
    r = _script("store_and_replay.py", "--connect", address, "--url", url, "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = ActivationRun(out / "run")
    rows = run.manifest["rows"]
    assert set(rows) == {"L1.post_block", "L3.post_block"} and rows["L1.post_block"] > 1000
    assert rows["L1.post_block"] == rows["L3.post_block"] and run.verify() == []
    assert run.dtype == "float32" and run.reduction.kind == "bf16"
    assert ActivationRun(out / "copy").manifest["rows"] == rows
    summary = json.loads((out / "sae.json").read_text())
    assert summary["steps"] >= 100  # --from without --epochs: about 200
    (ckpt,) = [d for d in (out / "saes").iterdir() if (d / "cfg.json").exists()]
    sae = load_sae(ckpt)
    assert sae.cfg.layer == 3 and sae.cfg.d_in == run.hidden_size
    assert "the same rows" in r.stdout


def test_closed_loop(server, tiny_models, tmp_path):
    """The closed loop against the server: a probe trains live from tagged requests and
    pushes into the monitor (later requests scored by newer versions); on held-out
    untagged requests the live monitor's decisions, read from the HTTP responses, are
    the saved probe's own on HF transformers' hidden states (so the same accuracy), and
    that accuracy is the trainer's held-out accuracy; the probe's direction, gated by
    the monitor, changes only the requests the monitor flags."""
    import numpy as np

    from tests.support.oracle import hf_activations
    from trainers.checkpoint import load_probe

    address, url, control, *_ = server
    out = tmp_path / "loop"
    r = _script(
        "closed_loop.py", "--connect", address, "--url", url, "--control", control,
        "--out", str(out),
    )  # fmt: skip
    # What it saw is checked here first; its own verdict (exit status) last.
    assert (out / "closed_loop.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "closed_loop.json").read_text())
    push, layer = res["push"], res["layer"]
    assert push["errors"] == [] and len(push["versions"]) >= 3, push
    assert push["versions"] == sorted(set(push["versions"])), push
    rounds = res["round_versions"]  # the newest version scoring each round's requests
    assert rounds == sorted(rounds) and len(set(rounds)) >= 3, rounds

    # (a) Held-out accuracy: every score is the final push's, and is what the saved
    # probe reads off HF's stream (float32 both sides: 1e-4 is the oracle tolerance
    # of tests/monitor). A token's decision could differ only if its probability were
    # within that of 0.5; those are counted and bound the accuracy difference.
    probe = load_probe(res["probe"])
    right_live = right_ref = borderline = n = 0
    for row in res["heldout"]:
        assert set(row["versions"]) == {push["versions"][-1]}, row["versions"]
        ids = row["token_ids"]
        x = hf_activations(tiny_models["llama"], ids, [layer], ["post_block"])[
            (layer, "post_block")
        ]
        with torch.no_grad():
            ref = torch.sigmoid(probe(x.float()))[:, 0].double()
        got = torch.from_numpy(np.array(row["scores"], dtype=np.float32)).double()
        assert got.shape == ref.shape, (got.shape, ref.shape)
        assert float((got - ref).abs().max()) <= 1e-4, (got - ref).abs().max()
        borderline += int(((ref - 0.5).abs() <= 1e-4).sum())
        right_live += int(((got > 0.5).long() == row["label"]).sum())
        right_ref += int(((ref > 0.5).long() == row["label"]).sum())
        n += len(ids)
    live, own = right_live / n, right_ref / n
    print(f"held-out accuracy: live {live:.4f}, saved probe {own:.4f}, {borderline} borderline")
    assert live == res["live_accuracy"]
    assert abs(live - own) <= borderline / n, (live, own, borderline)
    assert live > 0.75, live  # numbers against words: the probe learned the label
    # The trainer's own held-out accuracy (its last window of held-out tagged requests,
    # at most one push older): other requests of the same kind, ~1000 tokens each, so a
    # binomial standard error near 0.01 on each side; 0.05 is about four of them.
    trainer = res["trainer_heldout_accuracy"]
    assert abs(live - trainer) <= 0.05, (live, trainer)

    # (b) Gated steering: requests whose highest score stays under the threshold are
    # bitwise the unsteered run (text, log probabilities, scores); flagged ones change.
    mixed = res["mixed"]
    flagged = [m for m in mixed if m["flagged"]]
    quiet = [m for m in mixed if not m["flagged"]]
    assert len(flagged) >= 2 and len(quiet) >= 2, [m["flagged"] for m in mixed]
    for m in mixed:
        assert m["flagged"] == (max(m["plain"]["scores"]) > res["threshold"])
        assert set(m["plain"]["versions"]) == {push["versions"][-1]}
    for m in quiet:
        assert m["plain"] == m["steered"], m
    for m in flagged:
        assert m["plain"]["logprobs"] != m["steered"]["logprobs"], m
    assert any(m["plain"]["text"] != m["steered"]["text"] for m in flagged)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_return_activations_in_process(tmp_path):
    """Journey 3, its own offline LLM: every request's rows come back, one per token fed
    (one for the request that asked for its last prompt token), at both layers."""
    out = tmp_path / "return"
    # vLLM's own CPU CI switch: torch.compile traces the model (taps and all) with
    # dynamo but skips inductor's code generation, which is most of an engine start
    # here; and the engine core in the script's process. What comes back, not the
    # compiled graph or the engine process, is under test (the Llama engine and the
    # servers cover those).
    r = _script("return_in_process.py", "--out", str(out), env=IN_PROCESS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    saved = torch.load(out / "activations.pt")
    assert len(saved) == 8
    for i, req in enumerate(saved):
        n = len(req["positions"])
        assert n == 1 if i == 0 else n > 10
        for layer in LAYERS:
            assert req[point_key(layer, "post_block")].shape == (n, 128)
        assert req["token_ids"].shape == (n,)


# ------------------------------------------------------------------ the README's blocks
# Run as pasted (tests/support/docs_blocks.py): in one directory, as one shell session
# (later blocks use $MODEL, $BUS and send() from "Serve and train live"), against the
# server above, which is up already.
REQUESTS = 16  # the README sends 64; a few suffice to train something and store it


def _bash(
    script: str, cwd: Path, name: str, timeout: float = 300, env: dict[str, str] | None = None
) -> str:
    """Run ``script`` in bash (``set -e``: a failing command fails the block); its
    output, which is also kept in ``cwd/name.log``."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    log = cwd / f"{name}.log"
    with open(log, "w") as f:
        r = subprocess.run(
            ["bash", "-e", "-c", script], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
            timeout=timeout,
        )  # fmt: skip
    out = log.read_text()
    print(out[-3000:])
    assert r.returncode == 0, out[-4000:]
    return out


def _readme_script(block_id: str, server, *, prologue: str = "") -> str:
    from tests.support.docs_blocks import block, shell_script

    address, url, *_ = server
    venv = Path(sys.executable).parent.parent
    code = shell_script(block(block_id).code, address=address, port=int(url.rsplit(":", 1)[1]),
                        venv=venv)  # fmt: skip
    return prologue + code.replace("send 64", f"send {REQUESTS}")


def _session(server, tiny_models) -> str:
    """What "Serve and train live" leaves in the shell: $MODEL, $BUS and send()."""
    import re

    from tests.support.docs_blocks import block

    address, url, *_ = server
    (send,) = re.findall(r"^send\(\) \{.*?^done; \}$", block("readme-serve").code, re.M | re.S)
    send = send.replace("localhost:8000", f"127.0.0.1:{url.rsplit(':', 1)[1]}")
    venv = Path(sys.executable).parent.parent
    return f". {venv}/bin/activate\nMODEL={tiny_models['llama']}\nBUS={address}\n{send}\n"


_STOP_JOBS = """
pids=$(jobs -p)  # the suite's epilogue: the server goes on, so its subscribers are stopped
kill -TERM $pids
for p in $pids; do
  wait $p && echo "docs-block: job $p exited 0" || echo "docs-block: job $p exited $?"
done
"""


def test_readme_serve_and_train(server, tiny_models, readme_dir):
    """ "Serve and train live": the trainers, W&B and the dashboard subscribe, the tagged
    requests go; stopped (SIGTERM, as the server's Ctrl-C would end their stream), each
    exits 0 and the trainers save their checkpoints, the probe's with its source."""
    address, *_ = server
    board_port = free_port()
    script = _readme_script("readme-serve", server)
    assert script.count("actbus dashboard --connect $BUS &") == 1
    script = script.replace("actbus dashboard --connect $BUS &",
                            f"actbus dashboard --connect $BUS --port {board_port} &")  # fmt: skip
    names = {"sae", "probe", "wandb", "dashboard"}
    wait = (  # before the requests: the README's 64 give them time to start, 16 do not
        f"{sys.executable} -c 'import sys; sys.path.insert(0, sys.argv[1]); import common; "
        f"common.wait_subscribed(sys.argv[2], set(sys.argv[3:]), 300)' "
        f"{ROOT}/examples {address} {' '.join(sorted(names))}\n"
    )
    script = script.replace(f"\nsend {REQUESTS}\n", f"\n{wait}send {REQUESTS}\n")
    out = _bash(script + _STOP_JOBS, readme_dir, "serve")
    assert out.count("docs-block: job") == 4 and out.count("exited 0") == 4, out[-3000:]
    sae = readme_dir / "out" / "saes" / "L3.post_block-topk-k8-x4"
    assert (sae / "cfg.json").exists(), sorted(p.name for p in (readme_dir / "out").rglob("*"))
    (probe,) = (readme_dir / "out" / "probes").glob("*/probe.json")
    source = json.loads(probe.read_text())["source"]
    assert source["address"] == address and source["hidden_size"] == 128, source
    assert list(readme_dir.glob("wandb/offline-run-*")), "actbus run wandb logged nothing"
    # docs/dashboards.md's reader, as pasted into a file, on that run (once W&B's service
    # process, which may outlive its client, has written its history).
    from consumers.wandb_offline import find_runs, history
    from tests.support.docs_blocks import block

    runs = find_runs(readme_dir / "wandb")
    wait_for(lambda: runs and history(runs[-1]), 60, "the W&B history", 0.5)
    (readme_dir / "wandb_read.py").write_text(block("dashboards-wandb-read").code)
    r = subprocess.run([sys.executable, "wandb_read.py"], cwd=readme_dir, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def test_readme_steer_over_http(server, tiny_models, readme_dir):
    """ "Steer", over HTTP: the SAE feature the live trainer saved, registered by name,
    steers greedy decoding visibly: the text differs from the same request unsteered."""
    from tests.support.docs_blocks import block

    assert (readme_dir / "out" / "saes").exists(), "needs test_readme_serve_and_train's SAE"
    _, url, *_ = server
    out = _bash(_readme_script("readme-steer-http", server), readme_dir, "steer-http")
    steered = json.loads(out.strip().splitlines()[-1])["choices"][0]["text"]
    assert '"temperature": 0' in block("readme-steer-http").code
    body = {"model": str(tiny_models["llama"]), "prompt": "a note", "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        plain = json.loads(r.read())["choices"][0]["text"]
    print(f"plain {plain!r}\nsteered {steered!r}")
    assert steered != plain


def test_readme_rows_over_http(server, tiny_models, readme_dir):
    """The README's rows over HTTP: the completion's rows at layer 3, one per token fed,
    read back by ``actbus.client``."""
    script = _readme_script("readme-return-http", server, prologue=_session(server, tiny_models))
    out = _bash(script, readme_dir, "return-http")
    body = json.loads((readme_dir / "r.json").read_text())
    fed = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    hidden = json.loads((Path(tiny_models["llama"]) / "config.json").read_text())["hidden_size"]
    assert out.strip().splitlines()[-1] == f"torch.Size([{fed}, {hidden}])", out[-500:]


def test_readme_store_and_replay(server, tiny_models, readme_dir):
    """ "Store and replay": the sink stores the requests' rows at both layers, the run
    reads back intact, an SAE trains from it, and the replayed copy holds the same rows;
    docs/datasets.md's example reads it."""
    from consumers.fs import ActivationRun
    from tests.support.docs_blocks import block

    script = _readme_script("readme-store", server, prologue=_session(server, tiny_models))
    script = script.replace("ipc:///tmp/replay.sock", f"ipc://{readme_dir}/replay.sock")
    out = _bash(script + "wait\n", readme_dir, "store")
    run = ActivationRun(readme_dir / "runs" / "today")
    rows = run.manifest["rows"]
    assert set(rows) == {"L1.post_block", "L3.post_block"} and rows["L1.post_block"] > 0, rows
    assert run.verify() == [] and f"{rows} []" in out  # what the block printed
    assert ActivationRun(readme_dir / "runs" / "copy").manifest["rows"] == rows
    # A completion's rows carry the response id plus "-0", its prompt's index (as
    # docs/selection.md says: what subscribers see of vLLM's ids).
    ids = run.request_ids(3)
    assert 0 < len(ids) <= REQUESTS and all(i.startswith("cmpl-") and i.endswith("-0") for i in ids)
    assert "steps on " in out and "saved: " in out  # the SAE from disk
    # docs/datasets.md's example reads the same run, as pasted into a file.
    (readme_dir / "read.py").write_text(block("datasets-read").code)
    r = subprocess.run([sys.executable, "read.py"], cwd=readme_dir, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    verified, last = r.stdout.splitlines()[-2:]
    assert verified == "[]" and last.startswith("torch.Size([") and '"label"' in last, r.stdout


# docs/http.md's Inspect block: a server of its own (a monitor made of the probe the
# README's serve block trained), then `inspect eval` of examples/inspect_probe.py.
_STOP_ON_EXIT = "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT  # the block's server, always\n"


def _examples_here(where: Path) -> None:
    """The blocks run from the checkout, where ``examples/`` is."""
    if not (where / "examples").exists():
        (where / "examples").symlink_to(ROOT / "examples")


def test_docs_inspect_eval(tiny_models, readme_dir):
    """docs/http.md's Inspect block, as pasted (its server on a port of the test's, its
    engine in the server's process and Dynamo-only: a start of half the time; what is
    under test is the eval, not the compiled graph): the eval succeeds and every sample's log
    holds the returned row and the ``refusal`` monitor's scores, and the scores Inspect
    computed from them are the probe on that row and the scores' mean."""
    from inspect_ai.log import read_eval_log

    from actbus.client import from_metadata
    from tests.support.docs_blocks import block, own_server_script

    probe = readme_dir / "out" / "probes" / "L1.post_block-probe-logistic"
    assert probe.is_dir(), "needs test_readme_serve_and_train's probe"
    _examples_here(readme_dir)
    venv = Path(sys.executable).parent.parent
    prologue = (
        f". {venv}/bin/activate\nMODEL={tiny_models['llama']}\n"
        f"BUS=ipc://{readme_dir}/inspect.sock\n{_STOP_ON_EXIT}"
    )
    script = prologue + own_server_script(block("http-inspect").code, port=free_port())
    _bash(script, readme_dir, "inspect", env=IN_PROCESS)
    (path,) = (readme_dir / "logs").glob("*.eval")
    log = read_eval_log(str(path))
    assert log.status == "success" and len(log.samples) == 4, (log.status, log.error)
    for sample in log.samples:
        assert {"activations", "monitor"} <= set(sample.output.metadata["actbus"]), sample.id
        got = from_metadata(sample.output.metadata)
        assert got.complete is True and list(got.tensors) == [(3, "post_block")]
        prompt_len = sample.output.usage.input_tokens
        assert got.positions.tolist() == [prompt_len - 1], (sample.id, got.positions)
        assert list(got.scores) == [("refusal", 1)]
        fed = prompt_len + sample.output.usage.output_tokens - 1
        assert got.score_positions.tolist() == list(range(fed))
        (score,) = sample.scores.values()
        mean = float(got.scores[("refusal", 1)].mean())
        assert score.value["monitor"] == pytest.approx(mean, rel=1e-5)
        row = got[(3, "post_block")][-1]
        w = torch.randn(row.numel(), generator=torch.Generator().manual_seed(0))
        assert score.value["probe"] == pytest.approx(float(torch.sigmoid(row @ (w / w.norm()))))


def test_docs_inspect_eval_fails_loudly(tmp_path):
    """The block's ``inspect eval``, against a server that refuses every chat call (as
    vLLM refuses one for a model without a chat template): it exits non-zero, naming
    the error (``inspect eval`` alone exits 0 and leaves it in the log)."""
    from tests.support.docs_blocks import block, command
    from tests.support.refusing import refusing_server

    _examples_here(tmp_path)
    with refusing_server(400, REFUSAL) as port:
        cmd = command(block("http-inspect").code, "inspect eval")
        cmd = cmd.replace("localhost:8000", f"127.0.0.1:{port}")
        venv = Path(sys.executable).parent.parent
        script = f". {venv}/bin/activate\nMODEL=tiny\n{cmd}\n"
        r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert REFUSAL in out, out[-3000:]


REFUSAL = "As of transformers v4.44, default chat template is no longer allowed"


def test_serve_and_train_live_until_the_server_stops(server, tmp_path):
    """Journey 1 against the server, stopped as a user stops it (Ctrl-C of ``actbus
    serve``) once the requests are in: an SAE and a probe trained on the live stream
    get END and save, both W&B runs (trainers' and the bus's) logged offline, the web
    dashboard saw the traffic. Runs after the other journeys: it stops the module's
    server. (Standalone, the script saved no checkpoint when END did not come: 14 min,
    exit 1.)"""
    from consumers.wandb_offline import history
    from trainers.checkpoint import load_sae

    address, url, _, proc, server_log = server
    out = tmp_path / "serve"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    script = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "serve_and_train.py"), "--connect", address,
         "--url", url, "--until-end", "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(script.stdout), daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: (
                any("waiting for the server to stop" in x for x in lines)
                or script.poll() is not None
            ),
            600,
            "the script's requests",
            0.5,
        )
        proc.send_signal(signal.SIGINT)  # Ctrl-C of actbus serve
        assert proc.wait(timeout=120) == 0
        rc = script.wait(timeout=600)
    finally:
        if script.poll() is None:
            script.kill()
        reader.join(timeout=10)
    stdout = "".join(lines)
    print(stdout[-3000:])
    assert rc == 0, stdout[-4000:]
    # END reached them (from the server's front end or from actbus serve after it), and
    # not a Ctrl-C of their own: they were sent none.
    assert "actbus serve: the server exited (0); told " in server_log.read_text()
    for name in ("sae", "probe"):
        assert "the publisher ended the stream" in (out / f"{name}.log").read_text(), name
    sae = json.loads((out / "sae.json").read_text())
    assert sae["steps"] >= 1 and sae["data"]["rows_in"] > 4000
    assert sae["policy"] == "drop_oldest" and sae["dropped"] <= sae["routed"]
    (ckpt,) = [d for d in (out / "saes").iterdir() if (d / "cfg.json").exists()]
    assert load_sae(ckpt).cfg.layer == 3
    probe = json.loads((out / "probe.json").read_text())
    assert probe["steps"] >= 1
    (weights,) = (out / "probes").glob("*/probe.safetensors")
    assert weights.stat().st_size > 0
    runs = sorted(out.rglob("*run-*/run-*.wandb"))
    assert len(runs) == 3, runs  # sae, probe, bus
    # W&B's service process may still be writing a run's file as its client exits.
    wait_for(lambda: all(history(run) for run in runs), 60, "every W&B run's history on disk", 0.5)
    board = json.loads((out / "dashboard.json").read_text())
    assert board["bus"]["tokens"] > 0 and {"L1.post_block", "L3.post_block"} <= {
        f"L{t['layer']}.{t['hook']}" for t in board["acts"]["taps"].values()
    }


def test_readme_steer_in_python(tmp_path):
    """ "Steer", in Python: the snippet pasted into a file and run (vLLM's engine process
    imports it again, so it needs its __main__ guard); greedy text, plain then steered,
    differs."""
    from tests.support.docs_blocks import block

    script = tmp_path / "steer.py"
    script.write_text(block("readme-steer-python").code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **IN_PROCESS}  # as journey 3
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plain, steered = [line for line in r.stdout.splitlines() if line.startswith(("'", '"'))][-2:]
    print(f"plain {plain}\nsteered {steered}")
    assert plain != steered


def test_causal_tracing_matches_hf_hooks(tmp_path):
    """``examples/causal_tracing.py`` (corrupt the subject's embeddings, restore one
    layer's clean state, both with ``replace``, in vLLM's compiled graph) prints the
    probabilities the same procedure gives in HF transformers with forward hooks: a
    pre-hook adding the noise to the first layer's input, a hook setting layer L's
    output at the last subject token to the clean run's."""
    from actbus.tiny_models import build_tiny_model
    from tests.support.oracle import hf_model

    out = tmp_path / "trace.json"
    env = IN_PROCESS
    r = _script("causal_tracing.py", "--out", str(out), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    model = hf_model(str(build_tiny_model("llama")))
    layers = model.model.layers
    ids, subject, target = got["prompt_ids"], got["subject"], got["target"]
    noise = torch.tensor(got["noise"])
    last = subject[-1]

    def run(corrupt: bool, restore: int | None, clean: list | None = None):
        handles, states = [], []

        def pre(_m, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).clone()
            x[0, subject] += noise
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        def post(_m, _a, o, i):
            h = (o[0] if isinstance(o, tuple) else o).clone()
            if i == restore:
                h[0, last] = clean[i]
            states.append(h[0, last].clone())
            return (h, *o[1:]) if isinstance(o, tuple) else h

        if corrupt:
            handles.append(layers[0].register_forward_pre_hook(pre, with_kwargs=True))
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(lambda m, a, o, i=i: post(m, a, o, i)))
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        return float(torch.softmax(logits.double(), -1)[target]), states

    p_clean, clean = run(False, None)
    assert abs(got["clean"] - p_clean) < 1e-5
    assert abs(got["corrupted"] - run(True, None)[0]) < 1e-5
    want = [run(True, i, clean)[0] for i in range(len(layers))]
    assert max(abs(a - b) for a, b in zip(got["restored"], want, strict=True)) < 1e-5, (
        got["restored"],
        want,
    )
    assert got["clean"] != got["corrupted"]
