"""GPU check (run through the device machine, not in CI): live pushes under CUDA graphs.

Serves a tiny Llama with vLLM's defaults on GPU (torch.compile + CUDA graphs) with a
raw-direction monitor at layers 1 and 3 and a control endpoint. A thread pushes new
weights every few milliseconds while a batch generates with its scores returned;
the double-buffered tables (``actbus.monitor.swap``: back slot written on a side
stream, front index flipped in stream order) must give every step one version whole:

- a position's scores at both layers carry the same version (one forward);
- a request's versions never go back;
- every score equals its version's weights applied to HF transformers' stream on the
  same GPU and dtype (relative to ``||w|| ||x|| + |b|``), so no step read a slot
  mid-write or the other version's slot;
- compilations and CUDA graph captures do not change.

Prints one JSON line (``swap_ms`` p50/p99 from the endpoint's status too).

    python tests/gpu/check_push.py --dtype bfloat16 --runner v1   # or v2; --tp 2 | --pp 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYERS = [1, 3]
HOOK = "post_block"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--runner", default="v1", choices=["v1", "v2"])
    ap.add_argument("--tol", type=float, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    ap.add_argument("--every-ms", type=float, default=5.0, help="time between pushes")
    args = ap.parse_args()
    from tests.support.installed import gpu_memory, require_actbus_plugin

    require_actbus_plugin()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(compile_counts)

    import numpy as np
    import torch

    from actbus.bus.control import ControlClient
    from actbus.tiny_models import build_tiny_model
    from tests.support.compile_counts import compile_counts
    from tests.support.oracle import hf_activations

    hidden = 256
    path = build_tiny_model("llama", hidden_size=hidden, intermediate_size=512)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tmp = tempfile.mkdtemp()
    control = f"ipc://{tmp}/control.sock"
    llm = LLM(
        str(path),
        dtype=args.dtype,
        **gpu_memory(),
        max_model_len=640,
        max_num_batched_tokens=256,
        max_num_seqs=32,
        seed=0,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        additional_config={
            "actbus": {
                "publish": f"ipc://{tmp}/bus.sock",
                "layers": [0],
                "requests": "selected",
                "monitor": {
                    "monitors": {"m": {"weight": [0.0] * hidden, "layers": LAYERS, "hook": HOOK}}
                },
                "control": control,
            }
        },
    )
    dt = getattr(torch, args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(8 + 5 * i)] for i in range(24)]
    x0 = hf_activations(path, prompts[0], [LAYERS[0]], [HOOK], dtype=dt, device=args.device)
    typical = float(x0[(LAYERS[0], HOOK)].float().norm(dim=-1).mean())
    params = SamplingParams(
        temperature=0,
        max_tokens=48,
        ignore_eos=True,
        extra_args={"actbus": {"monitor": ["m"], "monitor_return": True}},
    )
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    before = llm.collective_rpc(compile_counts)

    pushed: dict[int, tuple[np.ndarray, float]] = {}
    stop = threading.Event()
    failures: list[str] = []

    def pusher() -> None:
        gen = np.random.default_rng(1)
        try:
            with ControlClient(control, timeout_s=30) as c:
                i = 0
                while not stop.is_set():
                    w = (gen.standard_normal(hidden) / typical).astype(np.float32)
                    b = 1.5 if i % 2 else -1.5
                    pushed[c.push("m", w, [b])["version"]] = (w, b)
                    i += 1
                    stop.wait(args.every_ms / 1e3)
        except Exception as e:
            failures.append(repr(e))

    thread = threading.Thread(target=pusher, daemon=True)
    thread.start()
    while not pushed and not failures:
        time.sleep(0.01)
    t0 = time.monotonic()
    outs = llm.generate(batch, params, use_tqdm=False)
    gen_s = time.monotonic() - t0
    stop.set()
    thread.join(timeout=30)
    after = llm.collective_rpc(compile_counts)
    with ControlClient(control, timeout_s=30) as c:
        swaps = [s["swap_ms"] for s in c.swaps() if s["version"] in pushed]

    torch.set_float32_matmul_precision("highest")
    problems = list(failures)
    worst, rows, seen = 0.0, 0, set()
    for o in outs:
        ms = o.outputs[0].monitor_scores
        fed = (list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[:-1]
        if ms is None or not ms.complete or ms.positions.tolist() != list(range(len(fed))):
            problems.append(f"{o.request_id}: returned scores missing or incomplete")
            continue
        v0, v1 = (ms.versions[("m", layer)].tolist() for layer in LAYERS)
        if v0 != v1:
            problems.append(f"{o.request_id}: one forward, two versions: {v0} vs {v1}")
        if v0 != sorted(v0):
            problems.append(f"{o.request_id}: versions went back: {v0}")
        seen.update(v0)
        acts = hf_activations(path, fed, LAYERS, [HOOK], dtype=dt, device=args.device)
        for layer, versions in zip(LAYERS, (v0, v1), strict=True):
            x = acts[(layer, HOOK)].double().cpu()
            got = ms.values[("m", layer)][:, 0].double()
            for j, v in enumerate(versions):
                if v not in pushed:
                    problems.append(f"{o.request_id}: version {v} was not pushed here")
                    break
                w, b = pushed[v]
                wt = torch.from_numpy(w).double()
                ref = float(x[j] @ wt + b)
                err = abs(float(got[j]) - ref) / (float(wt.norm() * x[j].norm()) + abs(b))
                worst = max(worst, err)
                rows += 1
    tol = args.tol or (1e-4 if args.dtype == "float32" else 2e-2)
    ok = not problems and worst <= tol and before == after and len(seen) >= 3
    report = {
        "check": "push_swap_gpu",
        "ok": ok,
        "dtype": args.dtype,
        "tp": args.tp,
        "pp": args.pp,
        "runner_requested": args.runner,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gen_s": round(gen_s, 2),
        "rows_checked": rows,
        "versions_seen": len(seen),
        "pushes": len(pushed),
        "swap_ms_p50": round(float(np.percentile(swaps, 50)), 2) if swaps else None,
        "swap_ms_p99": round(float(np.percentile(swaps, 99)), 2) if swaps else None,
        "max_rel_err": worst,
        "tolerance": tol,
        "compile_counts_before": before,
        "after": after,
        "problems": problems[:10],
    }
    print(json.dumps(report))
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
