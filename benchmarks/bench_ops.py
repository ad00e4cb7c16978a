"""Generation throughput with actbus's other operations (replace, ablate, clamp) and a
user hook vs plain vLLM, in one run (GPU).

Llama-3-8B shape with dummy weights (``engine_arms.LLAMA3_8B``), PROMPTS prompts of
INPUT random token ids, OUTPUT new tokens each, vLLM's defaults (torch.compile, CUDA
graphs). Each arm runs in its own process (a fresh engine):

    plain         actbus not loaded
    replace_1     every request replaces 8 prompt rows at layer 16 (patching)
    ablate_all    every request ablates one direction at every layer, every token
    clamp_1       every request clamps latent 123 of a 16x SAE at layer 16 (the SAE,
                  random, is written to a temporary directory: 2 x 1 GiB in bf16)
    hook_1        a trivial user hook at layer 16 on every request (actbus.user_hooks,
                  in process; CUDA graphs piecewise, split at the hook's op)
    lens_hook_1   vllm-lens 1.2.1's generic hook at layer 16 (a peer plugin; it forces
                  eager mode), the same trivial function

Each arm loads only its own plugin (``VLLM_PLUGINS``). The engines of the actbus arms
list only the operations they use (``actbus.steer.ops``). A peer arm that cannot run
here (vllm-lens not installed, or ``--tiny`` on CPU) is skipped with its reason, in
the table and in the JSON line (``skipped_<arm>``).

Prints a table, then one JSON line with every figure and ``ratio_<arm>``.

    python benchmarks/bench_ops.py [--prompts 512 --input 256 --output 256]
    python benchmarks/bench_ops.py --tiny      # a CPU check with the tiny Llama
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time

from engine_arms import (
    FAILED,
    RESULT,
    ArmFlags,
    Parallel,
    add_bench_args,
    arm_argv,
    bus_template,
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

LAYER = 16
TINY_LAYER = 2  # the tiny Llama has 4 layers
PATCHED = 8  # prompt rows each replace_1 request replaces
SAE_EXPANSION = 16
FEATURE = 123
ARMS = ("plain", "replace_1", "ablate_all", "clamp_1", "hook_1", "lens_hook_1")
OPS = {"replace_1": "replace", "ablate_all": "ablate", "clamp_1": "clamp"}
PLUGINS = {"plain": "no-plugin", "lens_hook_1": "activations"}  # else "actbus"


def skip_reason(name: str, tiny: bool) -> str | None:
    """Why an arm cannot run here (None: it can)."""
    if name == "hook_1" and importlib.util.find_spec("actbus.hooks") is None:
        return "actbus has no user hooks in this build"
    if name == "lens_hook_1":
        if tiny:
            return "vllm-lens is a GPU peer: not run on CPU (--tiny)"
        if importlib.util.find_spec("vllm_lens") is None:
            return "vllm-lens is not installed (pip install vllm-lens==1.2.1)"
    return None


def write_sae(directory: str, hidden: int, d_sae: int) -> str:
    """A random JumpReLU SAE in SAELens' inference format, bf16 (only latent FEATURE's
    two rows are read by the engine)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    t = {
        "W_enc": (torch.randn(hidden, d_sae, generator=g) / hidden**0.5).bfloat16(),
        "b_enc": torch.zeros(d_sae).bfloat16(),
        "b_dec": torch.zeros(hidden).bfloat16(),
        "W_dec": (torch.randn(d_sae, hidden, generator=g) / d_sae**0.5).bfloat16(),
        "threshold": torch.full((d_sae,), 0.01).bfloat16(),
    }
    save_file(t, f"{directory}/sae_weights.safetensors")
    cfg = {"architecture": "jumprelu", "d_in": hidden, "d_sae": d_sae}
    with open(f"{directory}/cfg.json", "w") as f:
        json.dump(cfg, f)
    return directory


def entries(name: str, i: int, layer: int, layers: int, hidden: int, sae: str | None, g):
    """One request's operation (``i``: the request, for its own rows)."""
    import torch

    if name == "replace_1":
        rows = torch.randn(PATCHED, hidden, generator=g).numpy()
        return [
            {
                "op": "replace",
                "layers": layer,
                "positions": list(range(1, 1 + PATCHED)),
                "rows": rows,
            }
        ]
    if name == "ablate_all":
        d = torch.randn(hidden, generator=torch.Generator().manual_seed(7)).numpy()
        return [{"op": "ablate", "layers": list(range(layers)), "directions": d}]
    if name == "clamp_1":
        return [{"op": "clamp", "layers": layer, "sae": sae, "feature": FEATURE, "value": 4.0}]
    raise ValueError(name)


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One arm, in this process: start the engine, generate, time it."""
    import torch
    from vllm import SamplingParams

    path, config = model(args.tiny)
    par = Parallel.of(args)
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    layer = TINY_LAYER if args.tiny else LAYER
    extra: dict = {}
    sae = None
    if name in OPS:
        extra = {
            "actbus": {
                "publish": bus_template(tempfile.mkdtemp(), "bus", par),
                "layers": [layer],
                "requests": "selected",  # nothing captured: the operation alone
                "steer": {
                    "layers": list(range(n_layers)) if name == "ablate_all" else [layer],
                    "hooks": ["post_block"],
                    "ops": [OPS[name]],
                },
            }
        }
        if name == "clamp_1":
            sae = args.sae  # written once by main(), outside the arm's time limit
    kw: dict = {}
    if name == "hook_1":  # in process (a Hook object), the graph split at the hook's op
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        extra = {
            "actbus": {
                "publish": bus_template(tempfile.mkdtemp(), "bus", par),
                "layers": [layer],
                "requests": "selected",
                "user_hooks": {"layers": [layer], "points": ["post_block"]},
            }
        }
        if not args.tiny:
            from vllm.config import CompilationConfig

            split = [*CompilationConfig._attention_ops, "actbus::user_hook"]
            kw["compilation_config"] = {"cudagraph_mode": "PIECEWISE", "splitting_ops": split}
    t0 = time.monotonic()
    llm = make_llm(
        path,
        tiny=args.tiny,
        input_len=args.input,
        output_len=args.output,
        extra=extra,
        parallel=par,
        **kw,
    )
    start_s = time.monotonic() - t0
    prompts = random_prompts(args.prompts, args.input, config["vocab_size"])
    base = dict(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(0)
    if name in OPS:
        params = [
            SamplingParams(
                **base,
                extra_args={"actbus": {"steer": entries(name, i, layer, n_layers, hidden, sae, g)}},
            )
            for i in range(len(prompts))
        ]
    elif name == "hook_1":
        from actbus.hooks import Hook

        hook = Hook(lambda call: None, layer=layer)  # the trivial hook: called, reads nothing
        params = [
            SamplingParams(**base, extra_args={"actbus": {"user_hooks": [hook]}}) for _ in prompts
        ]
    elif name == "lens_hook_1":
        from vllm_lens import Hook

        hook = Hook(lambda x: x, layer_indices=[layer])  # the trivial hook: reads, returns
        params = [SamplingParams(**base, extra_args={"hooks": [hook]}) for _ in prompts]
    else:
        params = [SamplingParams(**base) for _ in prompts]
    warm_up(llm, prompts)
    _, timed = timed_generate(llm, prompts, params)
    result = {"config": name, "engine_start_s": round(start_s, 1), **timed}
    shutdown(llm)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arms = ArmFlags(ARMS)
    add_bench_args(ap, arms)
    ap.add_argument("--sae", help=argparse.SUPPRESS)  # clamp_1's SAE, written by main()
    args = parse_bench_args(ap, arms)
    if args.one:
        print(RESULT + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    skipped = {n: why for n in args.arms if (why := skip_reason(n, args.tiny)) is not None}
    for n, why in skipped.items():
        print(f"  {n:16s} skipped: {why}", flush=True)
    run = [n for n in args.arms if n not in skipped]
    plugins = lambda n: PLUGINS.get(n, "actbus")  # noqa: E731
    argv = arm_argv(args)
    with tempfile.TemporaryDirectory(prefix="bench-sae-") as sae_dir:  # 2 GiB: not left behind
        if "clamp_1" in run:  # written before any arm's clock
            hidden = model(args.tiny)[1]["hidden_size"]
            argv += ["--sae", write_sae(sae_dir, hidden, SAE_EXPANSION * hidden)]
        results = run_arms(__file__, run, argv, plugins, args.arm_timeout)
    summary = throughput_table(results, args, width=14)
    for name, why in skipped.items():
        print(f"{name:14s} skipped: {why}")
        summary[f"skipped_{name}"] = why
    summary.update(FAILED)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
