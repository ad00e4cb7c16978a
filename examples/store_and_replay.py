"""Journey 2: store the residual stream to disk, then train from the run and replay it.

    python examples/store_and_replay.py                      # the tiny Llama, on CPU
    python examples/store_and_replay.py --gpu --model PATH --layers 8,16
    python examples/store_and_replay.py --connect ADDR --url http://HOST:PORT  # a running server

1. `actbus run fs-sink` subscribes and stores two layers in bf16;
2. an offline `vllm.LLM` with capture on generates for tagged prompts (or, against a
   running server, the prompts go over HTTP);
3. the run is read back: rows per layer, its checksums, one request's activations;
4. `actbus run sae --from RUN` trains from disk (on the requests tagged label=1 only,
   as `--match` filters a live stream);
5. `actbus replay RUN` puts the run back on the bus, where a second sink stores it
   again: the same rows.

Everything lands under --out (default out/journey-store).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import common


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(common.ROOT / "out" / "journey-store"))
    p.add_argument("--prompts", type=int, default=48, help="tagged prompts to generate for")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--connect", default=None, help="a running server's bus address")
    p.add_argument("--url", default=None, help="a running server's URL (with --connect)")
    common.add_model_args(p)
    args = p.parse_args()
    if (args.connect is None) != (args.url is None):
        p.error("--connect and --url go together (a running server)")
    model = common.model_of(args)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # a journey starts clean
    out.mkdir(parents=True)
    run_dir, copy_dir = out / "run", out / "copy"
    layers = ",".join(map(str, model.layers))
    address = args.connect or f"ipc://{tempfile.mkdtemp(prefix='actbus-journey-')}/bus.sock"

    common.step(1, 5, f"actbus run fs-sink --out {run_dir} --layers {layers} --reduce bf16")
    sink = common.actbus(
        "run", "fs-sink", "--connect", address, "--out", str(run_dir), "--layers", layers,
        "--reduce", "bf16", "--flush-s", "2", log=out / "sink.log",
    )  # fmt: skip
    items = common.prompts(args.prompts)
    if args.connect is None:
        common.step(2, 5, f"vllm.LLM with capture on layers {layers}, {len(items)} prompts")
        llm = _offline_llm(model, address)
        rows = _generate(llm, items, args.max_tokens)
        _wait_rows(run_dir, model.layers, rows, sink)
        llm.llm_engine.engine_core.shutdown()
    else:
        common.wait_subscribed(address, {"fs-sink"}, 120)
        common.step(2, 5, f"{len(items)} prompts to {args.url}")
        served = common.get_json(f"{args.url}/v1/models")["data"][0]["id"]
        rows = common.send_all(args.url, served, items, args.max_tokens)
        _wait_rows(run_dir, model.layers, rows, sink)
    sink_rc = common.finish(sink, 60, signal.SIGTERM)  # commits what it holds, exits

    from consumers.fs import ActivationRun

    common.step(3, 5, f"the run, read back from {run_dir}")
    run = ActivationRun(run_dir)
    problems = run.verify()
    print(f"      rows {run.manifest['rows']}, dtype {run.dtype}, checks: {problems or 'intact'}")
    rid = run.request_ids(model.layers[-1])[0]
    x = run.request(rid, model.layers[-1])
    print(f"      request {rid}: {tuple(x.shape)} {x.dtype} at layer {model.layers[-1]}")
    print(run.dataset(layer=model.layers[-1]).head(2).select(["request_id", "position", "tags"]))

    common.step(4, 5, "actbus run sae --from RUN --match label=1")
    sae = common.actbus(
        "run", "sae", "--from", str(run_dir), "--layer", str(model.layers[-1]),
        "--match", "label=1", "--k", "8", "--expansion", "4", "--out", str(out / "saes"),
        "--summary", str(out / "sae.json"), "--no-progress", *model.trainer_flags(),
        log=out / "sae.log", env={"WANDB_MODE": "offline"},
    )  # fmt: skip
    sae_rc = common.finish(sae, 600)
    trained = json.loads((out / "sae.json").read_text()) if sae_rc == 0 else {"steps": 0}
    saved = sorted(d for d in (out / "saes").glob("L*") if (d / "cfg.json").exists())
    print(f"      {trained['steps']} steps; saved {[str(d) for d in saved]}")

    common.step(5, 5, f"actbus replay RUN -> a second fs-sink in {copy_dir}")
    replay_address = f"ipc://{tempfile.mkdtemp(prefix='actbus-replay-')}/bus.sock"
    replay = common.actbus(
        "replay", str(run_dir), "--publish", replay_address, log=out / "replay.log"
    )
    copy = common.actbus(
        "run", "fs-sink", "--connect", replay_address, "--out", str(copy_dir), "--exit-on-end",
        log=out / "copy.log",
    )  # fmt: skip
    replay_rc, copy_rc = common.finish(replay, 300), common.finish(copy, 120)
    copied = ActivationRun(copy_dir).manifest["rows"] if copy_rc == 0 else {}
    same = copied == run.manifest["rows"]
    print(f"      replayed and stored again: {copied} ({'the same rows' if same else 'DIFFERENT'})")
    ok = sink_rc == 0 and not problems and sae_rc == 0 and trained["steps"] > 0 and saved
    return 0 if ok and replay_rc == 0 and same else 1


def _offline_llm(model: common.Model, address: str):
    """An offline LLM whose capture publishes ``model.layers`` on ``address``."""
    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(
        model.path,
        **model.llm_kwargs(),
        additional_config={"actbus": {"publish": address, "layers": list(model.layers)}},
    )
    print(f"      engine up in {time.monotonic() - t0:.0f}s")
    return llm


def _generate(llm, items: list, max_tokens: int) -> int:
    """Generate for tagged prompts (each request's tags in its selection); the rows
    each tapped layer gets: every token fed to the model."""
    from vllm import SamplingParams

    prompts = [text for text, _ in items]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, extra_args={"actbus": {"tags": t}})
        for _, t in items
    ]
    outs = llm.generate(prompts, params)
    return sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)


def _wait_rows(run_dir: Path, layers: tuple[int, ...], rows: int, sink) -> None:
    """Until the sink has committed every row the requests fed, at every layer."""
    from actbus.streams import point_key
    from consumers.fs import ActivationRun

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            got = ActivationRun(run_dir).manifest["rows"]
        except FileNotFoundError:
            got = {}
        if all(got.get(point_key(layer, "post_block"), 0) >= rows for layer in layers):
            return
        if sink.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit(f"the sink did not store {rows} rows per layer; see its log")


if __name__ == "__main__":
    sys.exit(main())
