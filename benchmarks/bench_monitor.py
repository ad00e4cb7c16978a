"""Generation throughput with actbus monitors vs plain vLLM, in one run (GPU).

Llama-3-8B shape with dummy weights (``engine_arms.LLAMA3_8B``), PROMPTS prompts of
INPUT random token ids, OUTPUT new tokens each, vLLM's defaults (torch.compile, CUDA
graphs). Each configuration runs in its own process (a fresh engine):

    plain              actbus not loaded
    monitor_probe_4    a probe direction (sigmoid) at layers 4, 12, 20, 28 on every token
                       of every request, scores returned to the caller
                       (``"monitor_return": true``: ``CompletionOutput.monitor_scores``),
                       while a client pushes new probe weights every PUSH_EVERY_S over
                       the engine's control endpoint (``swap_ms``, below)
    monitor_sae_1      64 features of a ReLU SAE (1024 latents) at layer 16, the same way
    gated_steer        every request steered at layer 16 by a vector gated (hard, 0.5) by
                       a sigmoid probe monitor at layer 12 of the same token
    monitor_probe_4_bus  (only when named) monitor_probe_4 with the scores read by a
                       lossless (``block``) bus subscriber instead of returned
    monitor_probe_4_graph, monitor_sae_1_graph  (only when named) scored in the graph
                       and read by no one: what the graph itself costs
    monitor_probe_4_static  (only when named) monitor_probe_4 without the pushes

Returned scores are counted: every request must get prompt + generated - 1 rows per
monitor layer, or the arm fails.

Capture is restricted to no request (``requests: selected``), so only monitoring is
measured. Prints a table, then one JSON line with every figure and ``ratio_<config>``
(tokens per second against ``plain``). ``swap_ms_p50`` / ``swap_ms_p99``: over the
pushes of the timed generation, the time from a push's arrival at the engine to the
scheduling of the first step that reads it (the engine's own figure, from the control
endpoint's ``status``); ``pushes_used`` of ``pushes_sent`` were used by a step (a push
that arrives before the previous one was used replaces it).

``--tp``, ``--pp`` and ``--dp`` set every arm's parallelism alike
(``engine_arms.add_parallel_args``). Under data parallelism each rank has its own
publisher and control endpoint: every push goes to each rank, a bus arm reads each
rank's scores with its own reader, and the swap times are over every rank's pushes.

    python benchmarks/bench_monitor.py [--prompts 512 --input 256 --output 256]
    python benchmarks/bench_monitor.py --tiny      # a CPU check with the tiny Llama
    python benchmarks/bench_monitor.py --tp 2      # every arm at tensor parallel 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine_arms import (
    FAILED,
    RESULT,
    ROOT,
    ArmFlags,
    CostMeter,
    Parallel,
    add_bench_args,
    arm_argv,
    bus_template,
    cost_line,
    make_llm,
    model,
    parse_bench_args,
    random_prompts,
    run_arms,
    shutdown,
    throughput_table,
    timed_generate,
    warm_up,
)

TINY_LAYERS = {16: 2, 4: 0, 12: 1, 20: 2, 28: 3}  # the tiny Llama has 4 layers


@dataclass(frozen=True)
class Arm:
    kind: str  # "probe" | "sae"
    layers: list[int]
    returned: bool = True  # scores back to the caller, else to a bus subscriber
    gate_layer: int | None = None  # steer this layer (16) gated by the monitor's score
    read: bool = True  # False: scored in the graph, read by no one (the graph's own cost)
    push: bool = False  # push new weights every PUSH_EVERY_S while generating


CONFIGS: dict[str, Arm | None] = {
    "plain": None,
    "monitor_probe_4": Arm("probe", [4, 12, 20, 28], push=True),
    "monitor_sae_1": Arm("sae", [16]),
    "gated_steer": Arm("probe", [12], returned=False, gate_layer=16),
}
EXTRA_CONFIGS: dict[str, Arm] = {
    "monitor_probe_4_bus": Arm("probe", [4, 12, 20, 28], returned=False),
    "monitor_probe_4_static": Arm("probe", [4, 12, 20, 28]),  # no pushes
    "monitor_probe_4_graph": Arm("probe", [4, 12, 20, 28], returned=False, read=False),
    "monitor_sae_1_graph": Arm("sae", [16], returned=False, read=False),
}
PUSH_EVERY_S = 0.1
SAE_LATENTS = 1024
SAE_FEATURES = list(range(64))


def _sae_checkpoint(path: Path, hidden: int) -> None:
    """A ReLU SAE in the format ``actbus run sae`` writes (SAELens' inference format)."""
    # numpy, not torch: a torch CPU op big enough to start OpenMP threads in this
    # process hangs the engine core vLLM then forks (at its first parallel op).
    import numpy as np
    from safetensors.numpy import save_file

    w_dec = np.random.default_rng(0).standard_normal((SAE_LATENTS, hidden), dtype=np.float32)
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "W_enc": np.ascontiguousarray(w_dec.T),
            "b_enc": np.zeros(SAE_LATENTS, dtype=np.float32),
            "W_dec": w_dec,
            "b_dec": np.zeros(hidden, dtype=np.float32),
        },
        str(path / "sae_weights.safetensors"),
    )
    cfg = {
        "architecture": "standard",
        "d_in": hidden,
        "d_sae": SAE_LATENTS,
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
    }
    (path / "cfg.json").write_text(json.dumps(cfg))


def _monitor(arm: Arm, tmp: Path, hidden: int, layers: list[int]) -> dict:
    if arm.kind == "probe":
        import torch

        w = torch.randn(hidden, generator=torch.Generator().manual_seed(1)) / hidden**0.5
        src = {"weight": w.tolist(), "bias": 0.0, "sigmoid": True}
    else:
        _sae_checkpoint(tmp / "sae", hidden)
        src = {"sae": str(tmp / "sae"), "features": SAE_FEATURES}
    return {"monitors": {"m": {**src, "layers": layers}}, "global": ["m"]}


def read_scores(address: str) -> int:
    """The subscriber arm: read every score message until the engine ends (lossless)."""
    from actbus.monitor.reader import ScoreReader, ScoreStep

    messages = rows = 0
    # window: the most messages in flight a publisher grants (max 1024)
    with ScoreReader(address, policy="block", window=1024, welcome_timeout_s=600) as reader:
        print("READY", flush=True)
        for step in reader:
            if isinstance(step, ScoreStep):
                messages += 1
                rows += sum(len(s.positions) for s in step.scores)
        missed = reader.stats.missed
    print(json.dumps({"messages": messages, "rows": rows, "missed": missed}), flush=True)
    return 0


class Pusher:
    """Pushes new weights for monitor ``m`` every PUSH_EVERY_S from a thread, until
    closed; then reads the engine's swap times of the versions it pushed. Under data
    parallelism ``addresses`` are every rank's control endpoints: each push goes to
    each rank (a rank numbers its own versions)."""

    def __init__(self, addresses: list[str], hidden: int) -> None:
        import threading

        import numpy as np

        from actbus.bus.control import ControlClient

        self._clients = [ControlClient(a, timeout_s=30) for a in addresses]
        self._rng = np.random.default_rng(3)
        self._hidden = hidden
        self.versions: list[list[int]] = [[] for _ in addresses]
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(PUSH_EVERY_S):
                w = self._rng.standard_normal(self._hidden).astype("float32") / self._hidden**0.5
                for client, versions in zip(self._clients, self.versions, strict=True):
                    versions.append(client.push("m", w, [0.0])["version"])
        except BaseException as e:  # reported by close()
            self.error = e

    def close(self) -> dict:
        """``swap_ms`` p50/p99 of the pushes used, and how many were sent and used
        (summed over ranks)."""
        import numpy as np

        self._stop.set()
        self._thread.join(timeout=60)
        swaps: list[float] = []
        sent = 0
        try:
            if self.error is not None:
                raise SystemExit(f"the pusher failed: {self.error!r}")
            for client, versions in zip(self._clients, self.versions, strict=True):
                mine = set(versions)
                sent += len(mine)
                swaps += [s["swap_ms"] for s in client.swaps() if s["version"] in mine]
        finally:
            for client in self._clients:
                client.close()
        out = {"pushes_sent": sent, "pushes_used": len(swaps)}
        if swaps:
            out["swap_ms_p50"] = round(float(np.percentile(swaps, 50)), 2)
            out["swap_ms_p99"] = round(float(np.percentile(swaps, 99)), 2)
        return out


def _count_returned(outs: list, layers: int) -> dict:
    """Returned score rows, against prompt + generated - 1 per request and layer."""
    rows = expected = incomplete = 0
    for o in outs:
        ms = getattr(o.outputs[0], "monitor_scores", None)
        expected += layers * (len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1)
        if ms is None:
            incomplete += 1
            continue
        rows += sum(len(v) for v in ms.values.values())
        incomplete += not ms.complete
    return {"rows": rows, "expected": expected, "incomplete": incomplete,
            "exact": rows == expected and not incomplete}  # fmt: skip


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration, in this process: start the engine, generate, time it."""
    from vllm import SamplingParams

    path, config = model(args.tiny)
    par = Parallel.of(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-mon-"))
    arm = CONFIGS.get(name) or EXTRA_CONFIGS.get(name)
    extra: dict = {}
    subs: list[subprocess.Popen] = []

    def layer(x: int) -> int:
        return TINY_LAYERS[x] if args.tiny else x

    if arm is not None:
        address = bus_template(str(tmp), "bus", par)
        layers = [layer(x) for x in arm.layers]
        extra = {
            "actbus": {
                "publish": address,
                "layers": [0],
                "requests": "selected",
                "queue_mb": 4096,
                "monitor": _monitor(arm, tmp, config["hidden_size"], layers),
            }
        }
        if arm.push:
            extra["actbus"]["control"] = bus_template(str(tmp), "control", par)
        if arm.gate_layer is not None:
            extra["actbus"]["monitor"]["global"] = []  # the gate reads it: scored anyway
            extra["actbus"]["steer"] = {"layers": [layer(arm.gate_layer)]}
    if arm is not None and not arm.returned and arm.read and arm.gate_layer is None:
        subs = [  # one reader per data-parallel rank's publisher
            subprocess.Popen(
                [sys.executable, __file__, "--read", a],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for a in par.addresses(address)
        ]
    t0 = time.monotonic()
    llm = make_llm(
        path,
        tiny=args.tiny,
        input_len=args.input,
        output_len=args.output,
        extra=extra,
        parallel=par,
    )
    start_s = time.monotonic() - t0
    prompts = random_prompts(args.prompts, args.input, config["vocab_size"])
    base = dict(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    params = SamplingParams(**base)
    if arm is not None and arm.returned:
        params = SamplingParams(**base, extra_args={"actbus": {"monitor_return": True}})
    if arm is not None and arm.gate_layer is not None:
        import torch

        from actbus.engine.api import vectors

        g = torch.Generator().manual_seed(2)
        vectors(llm).register("v", torch.randn(config["hidden_size"], generator=g))
        gate = {"monitor": "m", "threshold": 0.5, "source": "token"}
        entry = {"vector": "v", "layers": [layer(arm.gate_layer)], "scale": 0.5, "gate": gate}
        params = SamplingParams(**base, extra_args={"actbus": {"steer": [entry]}})
    warm_up(llm, prompts)
    pusher = None
    if arm is not None and arm.push:
        pusher = Pusher(par.addresses(extra["actbus"]["control"]), config["hidden_size"])
    meter = CostMeter(par.addresses(extra["actbus"]["publish"])) if arm is not None else None
    try:
        outs, timed = timed_generate(llm, prompts, params)
    finally:
        pushed = pusher.close() if pusher is not None else {}
    result = {
        "config": name,
        "engine_start_s": round(start_s, 1),
        **timed,
        **pushed,
    }
    if meter is not None:  # where the arm's cost lies: engine thread, front end
        result["cost"] = meter.result()
    if pusher is not None and not pushed["pushes_used"]:
        raise SystemExit(f"{name}: no push was used by a step: {pushed}")
    if arm is not None and arm.returned:
        result["returned"] = _count_returned(outs, len(arm.layers))
        if not result["returned"]["exact"]:
            raise SystemExit(f"{name}: returned scores miscounted: {result['returned']}")
    shutdown(llm)
    if subs:
        per = [_reader_stats(f"{name} (dp rank {r})", sub) for r, sub in enumerate(subs)]
        result["subscriber"] = {k: sum(p[k] for p in per) for k in ("messages", "rows", "missed")}
        if len(per) > 1:
            result["subscriber"]["rows_by_rank"] = [p["rows"] for p in per]
    return result


def _reader_stats(name: str, sub: subprocess.Popen) -> dict:
    """A score reader's counters, once it ended with the engine; one that read no
    scores measured nothing, and fails the run."""
    try:
        out, err = sub.communicate(timeout=120)  # the reader ends with the engine
    except subprocess.TimeoutExpired:
        sub.kill()
        out, err = sub.communicate(timeout=30)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    stats = json.loads(last) if last.startswith("{") else {}
    if not stats.get("rows"):
        raise SystemExit(f"{name}: the score reader received nothing:\n{err[-3000:]}")
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arms = ArmFlags((*CONFIGS, *EXTRA_CONFIGS), default=tuple(CONFIGS))
    add_bench_args(ap, arms)
    ap.add_argument("--read", help=argparse.SUPPRESS)
    if "--read" in sys.argv:
        return read_scores(ap.parse_args().read)
    args = parse_bench_args(ap, arms)
    if args.one:
        print(RESULT + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    plugins = lambda name: "no-plugin" if name == "plain" else "actbus"  # noqa: E731
    results = run_arms(__file__, args.arms, arm_argv(args), plugins, args.arm_timeout)
    summary = throughput_table(results, args, width=18)
    for name, r in results.items():
        if r.get("returned"):
            summary[f"returned_rows_{name}"] = r["returned"]["rows"]
            summary[f"returned_exact_{name}"] = r["returned"]["exact"]
        if "pushes_sent" in r:
            for k in ("pushes_sent", "pushes_used", "swap_ms_p50", "swap_ms_p99"):
                if k in r:
                    summary[k] = r[k]
            print(
                f"{name:18s} swap ms p50 {r.get('swap_ms_p50')} p99 {r.get('swap_ms_p99')} "
                f"({r['pushes_used']} of {r['pushes_sent']} pushes used)"
            )
        if c := r.get("cost"):
            summary.update({f"{k}_{name}": v for k, v in c.items() if k != "steps"})
            print(f"{name:18s} {cost_line(c)}")
        if r.get("subscriber"):
            summary[f"received_rows_{name}"] = r["subscriber"].get("rows", 0)
            summary[f"missed_{name}"] = r["subscriber"].get("missed", 0)
            if "rows_by_rank" in r["subscriber"]:
                summary[f"received_rows_by_rank_{name}"] = r["subscriber"]["rows_by_rank"]
    summary.update(FAILED)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
