"""What the engine-throughput benchmarks share: the model, the engine, the prompts,
the lossless bus subscriber, and one fresh process per arm.

``bench_capture.py`` and ``bench_return.py`` compare arms that differ only in what
actbus does; building every arm from these keeps that true. ``tiny`` swaps the
Llama-3-8B shape (dummy bf16 weights, for a GPU) for the tests' tiny Llama (float32,
on CPU), so a benchmark can be checked end to end where no GPU is.

``--tp``, ``--pp`` and ``--dp`` (``add_parallel_args``) set every arm's parallelism
alike, plain vLLM's included, so a run's ratios compare like with like. Data
parallelism runs through ``AsyncLLM`` (``dp_llm.DataParallelLLM``): vLLM refuses it
in the offline ``LLM``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actbus.bus.endpoints import for_rank
from actbus.cli import consumer_command

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
RESULT = "RESULT "
"""The prefix of an arm process's one line of results on stdout."""


def model(tiny: bool, moe: bool = False) -> tuple[Path, dict[str, Any]]:
    """The model directory and its config: the tiny Llama, or the Llama-3-8B shape
    (``moe``: the tiny Qwen3-MoE, or the Qwen3-30B-A3B shape)."""
    if tiny:
        from actbus.tiny_models import build_tiny_model

        path = build_tiny_model("qwen3_moe" if moe else "llama")
        return path, json.loads((path / "config.json").read_text())
    shape = QWEN3_30B_A3B if moe else LLAMA3_8B
    path = Path(tempfile.mkdtemp(prefix="bench-moe-" if moe else "bench-8b-"))
    (path / "config.json").write_text(json.dumps(shape))
    return path, shape


@dataclass(frozen=True)
class Parallel:
    """One run's parallelism, the same for every arm: tensor, pipeline and data
    parallel sizes."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @classmethod
    def of(cls, args: Any) -> Parallel:
        """From the parsed ``add_parallel_args`` flags."""
        return cls(args.tp, args.pp, args.dp)

    def argv(self) -> list[str]:
        """The flags that give an arm's process the same parallelism."""
        return ["--tp", str(self.tp), "--pp", str(self.pp), "--dp", str(self.dp)]

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's engine arguments for tensor and pipeline parallelism (data
        parallelism is ``dp_llm``'s: the offline ``LLM`` refuses it)."""
        return {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp}

    def summary(self) -> dict[str, int]:
        """For a benchmark's JSON line."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    def title(self) -> str:
        """For a benchmark's table header."""
        return f"parallelism: tp={self.tp} pp={self.pp} dp={self.dp} (every arm alike)"

    def addresses(self, template: str) -> list[str]:
        """The address each data-parallel rank's publisher binds for ``template``."""
        return [for_rank(template, r) for r in range(self.dp)]


def _size(text: str) -> int:
    """A parallel size: an integer from 1 to 64."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{n} is out of range: a size from 1 to 64")
    return n


def add_parallel_args(ap: argparse.ArgumentParser) -> None:
    """``--tp``, ``--pp`` and ``--dp``: every arm's parallelism, plain vLLM's included."""
    g = ap.add_argument_group("parallelism (every arm alike, plain vLLM's included)")
    g.add_argument("--tp", type=_size, default=1, help="tensor parallel size (default 1)")
    g.add_argument("--pp", type=_size, default=1, help="pipeline parallel size (default 1)")
    g.add_argument(
        "--dp",
        type=_size,
        default=1,
        help="data parallel size (default 1); above 1 the engine is AsyncLLM with the "
        "prompts spread over the ranks round-robin, one publisher per rank",
    )


SIZES = {
    "gpu": {"prompts": 512, "input": 256, "output": 256},
    "tiny": {"prompts": 16, "input": 32, "output": 32},
}
"""A run's prompts and lengths unless flags say otherwise: the GPU shape, or ``--tiny``."""


@dataclass(frozen=True)
class ArmFlags:
    """How a benchmark names its arms on the command line."""

    known: tuple[str, ...]
    """Every arm it has, in the order they run by default."""
    flag: str = "--configs"
    default: tuple[str, ...] | None = None
    """The arms run when the flag is not given (None: every known one)."""
    arm_timeout: float = 900.0
    gpu_prompts: int = 512


def add_bench_args(ap: argparse.ArgumentParser, arms: ArmFlags) -> None:
    """The flags every engine benchmark takes: the run's size (``--tiny`` for the CPU
    check), its arms, a limit per arm, its parallelism and the arm process's ``--one``."""
    ap.add_argument("--tiny", action="store_true", help="CPU check with the tiny Llama")
    ap.add_argument("--prompts", type=int, default=None, help=f"{arms.gpu_prompts} (--tiny: 16)")
    ap.add_argument("--input", type=int, default=None, help="prompt tokens: 256 (--tiny: 32)")
    ap.add_argument("--output", type=int, default=None, help="new tokens: 256 (--tiny: 32)")
    ap.add_argument(
        arms.flag,
        dest="arms",
        default=",".join(arms.default or arms.known),
        help=f"comma-separated arms, run in order; of {', '.join(arms.known)}",
    )
    ap.add_argument("--arm-timeout", type=float, default=arms.arm_timeout)
    add_parallel_args(ap)
    ap.add_argument("--one", help=argparse.SUPPRESS)


def parse_bench_args(ap: argparse.ArgumentParser, arms: ArmFlags) -> argparse.Namespace:
    """Parsed flags with the run's size filled in and ``args.arms`` a checked list."""
    args = ap.parse_args()
    sizes = dict(SIZES["tiny" if args.tiny else "gpu"])
    if not args.tiny:
        sizes["prompts"] = arms.gpu_prompts
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.one is None:
        args.arms = args.arms.split(",")
        if unknown := [n for n in args.arms if n not in arms.known]:
            ap.error(f"{arms.flag}: unknown {unknown}; choose from {list(arms.known)}")
    return args


def arm_argv(args: argparse.Namespace) -> list[str]:
    """The flags that give each arm's process this run's size and parallelism."""
    argv = ["--prompts", str(args.prompts), "--input", str(args.input)]
    argv += ["--output", str(args.output)] + (["--tiny"] if args.tiny else [])
    return argv + Parallel.of(args).argv()


def throughput_table(
    results: dict[str, dict[str, Any]], args: argparse.Namespace, width: int = 16
) -> dict[str, Any]:
    """Print each arm's tokens per second against plain vLLM's of the same run (the
    ``plain`` arm) and its engine start; return those figures for the JSON line."""
    par = Parallel.of(args)
    base = results.get("plain", {}).get("tok_per_s")
    print(f"\n{par.title()}")
    print(f"{'arm':{width}s} {'tok/s':>10s} {'vs plain':>9s} {'start s':>8s}")
    summary: dict[str, Any] = par.summary()
    for name, r in results.items():
        ratio = r["tok_per_s"] / base if base else float("nan")
        start = r.get("engine_start_s", float("nan"))
        print(f"{name:{width}s} {r['tok_per_s']:>10.1f} {ratio:>9.3f} {start:>8.1f}")
        summary[f"tok_per_s_{name}"] = r["tok_per_s"]
        if name != "plain":
            summary[f"ratio_{name}"] = round(ratio, 4)
    return summary


def bus_template(directory: str, name: str, par: Parallel) -> str:
    """An arm's publish (or control) address in ``directory``: a ``{dp_rank}``
    template under data parallelism, so each rank binds its own."""
    return (
        f"ipc://{directory}/{name}-{{dp_rank}}.sock"
        if par.dp > 1
        else f"ipc://{directory}/{name}.sock"
    )


def _bind_cpu_workers(par: Parallel) -> None:
    """On CPU, vLLM binds each worker to ``VLLM_CPU_OMP_THREADS_BIND``'s core list
    (ranks ordered DP, PP, TP); its ``auto`` wants a NUMA node per rank. Unless set,
    the workers take this process's cores round-robin, as the suite's TP x PP engine."""
    workers = par.dp * par.tp * par.pp
    if workers == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        str(cores[i % len(cores)]) for i in range(workers)
    )


def make_llm(
    path: Path,
    *,
    tiny: bool,
    input_len: int,
    output_len: int,
    extra: dict[str, Any],
    parallel: Parallel = Parallel(),
    **kw: Any,
) -> Any:
    """An offline ``vllm.LLM`` with vLLM's defaults (torch.compile, CUDA graphs on a
    GPU), token-id prompts and no prefix caching; ``extra`` is ``additional_config``.
    Under data parallelism, a ``dp_llm.DataParallelLLM`` with the same settings: an
    ``AsyncLLM`` behind the same ``generate``."""
    if tiny:
        # On CPU: the memory's share each worker reserves, and checks is free at its
        # start; split over the workers, so a parallel arm needs no more than one.
        workers = parallel.dp * parallel.tp * parallel.pp
        kw.setdefault("gpu_memory_utilization", round(0.3 / workers, 3))
        _bind_cpu_workers(parallel)
    settings = dict(
        load_format="auto" if tiny else "dummy",
        skip_tokenizer_init=True,
        dtype="float32" if tiny else "bfloat16",
        max_model_len=input_len + output_len + 8,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        seed=0,
        additional_config=extra,
        **parallel.engine_kwargs(),
        **kw,
    )
    if parallel.dp > 1:
        from importlib import import_module

        # Run as a script (``benchmarks/`` first on the path) or as ``benchmarks.*``.
        dp_llm = import_module(f"{__package__}.dp_llm" if __package__ else "dp_llm")
        return dp_llm.DataParallelLLM(str(path), data_parallel_size=parallel.dp, **settings)
    from vllm import LLM

    return LLM(str(path), **settings)


def shutdown(llm: Any) -> None:
    """Stop an arm's engine (its publishers send END to their subscribers)."""
    if hasattr(llm, "shutdown"):  # DataParallelLLM
        llm.shutdown()
    else:
        llm.llm_engine.engine_core.shutdown()


def rank_of(llm: Any, out: Any) -> int:
    """The data-parallel rank that served ``out`` (0 without data parallelism)."""
    return getattr(llm, "ranks", {}).get(out.request_id, 0)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[Any]:
    """``n`` prompts of ``length`` random token ids (the same for every arm)."""
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    low, high = min(1000, vocab // 4), min(vocab, 120000)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(low, high) for _ in range(length)])
        for _ in range(n)
    ]


def warm_up(llm: Any, prompts: list[Any], extra_args: dict[str, Any] | None = None) -> list[Any]:
    """A short generation before the timed one (compiles, graphs); its outputs."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False, extra_args=extra_args)
    return llm.generate(prompts[:16], sp, use_tqdm=False)


def timed_generate(llm: Any, prompts: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
    """The timed generation (after ``warm_up``): its outputs, and the arm's figures
    ``gen_s``, ``generated_tokens`` and ``tok_per_s`` (generated tokens per second)."""
    t0 = time.monotonic()
    # BENCH_PROGRESS=1: a progress bar on stderr, to see an arm's rate if it times out.
    outs = llm.generate(prompts, params, use_tqdm=os.environ.get("BENCH_PROGRESS") == "1")
    gen_s = time.monotonic() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, {
        "gen_s": round(gen_s, 2),
        "generated_tokens": generated,
        "tok_per_s": round(generated / gen_s, 1),
    }


def start_bus_subscriber(address: str, policy: str, hooks: str = "") -> subprocess.Popen:
    """A ``null`` consumer in its own process: receives every message and counts it
    (``hooks``: the hooks it names, e.g. ``router``, which only a naming subscriber gets)."""
    extra = ["--hooks", hooks] if hooks else []
    return subprocess.Popen(
        consumer_command("null", address, "--policy", policy, "--log-level", "WARNING", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def wait_subscribed(address: str, name: str, timeout: float = 120.0) -> None:
    """Until the publisher lists subscriber ``name`` (so it gets every message from now)."""
    from actbus.bus import Subscriber, Subscription
    from actbus.bus.statsview import request

    deadline = time.monotonic() + timeout
    with Subscriber(address, Subscription(layers=(), name="bench-check")) as sub:
        sub.wait_welcome(timeout)
        while name not in request(sub, 10)["subscribers"]:
            if time.monotonic() > deadline:
                raise SystemExit(f"subscriber {name!r} did not subscribe within {timeout:.0f}s")
            time.sleep(0.5)


def stop_bus_subscriber(name: str, sub: subprocess.Popen) -> dict[str, Any]:
    """Its counters (messages, rows, bytes, drops); a run whose subscriber received
    nothing measured nothing, and fails."""
    time.sleep(2.0)
    sub.terminate()
    out, err = sub.communicate(timeout=30)
    stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    if not stats.get("messages"):
        raise SystemExit(f"{name}: the subscriber received nothing:\n{err[-3000:]}")
    return stats


def start_bus_subscribers(
    template: str, policy: str, par: Parallel, hooks: str = ""
) -> list[subprocess.Popen]:
    """``start_bus_subscriber`` for each data-parallel rank's publisher, in rank order."""
    return [start_bus_subscriber(a, policy, hooks) for a in par.addresses(template)]


def wait_all_subscribed(template: str, name: str, par: Parallel) -> None:
    """``wait_subscribed`` on each data-parallel rank's publisher."""
    for address in par.addresses(template):
        wait_subscribed(address, name)


def stop_bus_subscribers(name: str, subs: list[subprocess.Popen]) -> dict[str, Any]:
    """Their counters summed (``stop_bus_subscriber``; every rank's must have received
    something), and under data parallelism each rank's own in ``per_rank``."""
    per = [stop_bus_subscriber(f"{name} (dp rank {r})", s) for r, s in enumerate(subs)]
    if len(per) == 1:
        return per[0]
    out: dict[str, Any] = {k: sum(p.get(k, 0) for p in per) for k in ("messages", "rows", "bytes")}
    dropped: dict[str, int] = {}
    for p in per:
        for k, v in (p.get("dropped_by_publisher") or {}).items():
            dropped[k] = dropped.get(k, 0) + v
    return out | {"dropped_by_publisher": dropped, "per_rank": per}


def engine_counters(address: str, timeout: float = 30.0) -> dict[str, float]:
    """The publisher's own counters of the engine's side: steps, tokens, seconds its
    thread spent in actbus (``capture_s``), stalled on lossless subscribers
    (``stall_s``), and the publisher thread's CPU. Taken before and after the timed
    generation, their difference says where an arm's cost lies."""
    from actbus.bus import Subscriber, Subscription
    from actbus.bus.statsview import request

    with Subscriber(address, Subscription(layers=(), name="bench-counters")) as sub:
        sub.wait_welcome(timeout)
        st = request(sub, timeout)
    keys = ("last_step", "tokens", "capture_s", "stall_s", "publisher_cpu_s")
    keys += ("queued_bytes_peak", "unpinned")
    out = {k: float(st.get(k, 0) or 0) for k in keys}
    for k, v in (st.get("pinned_host") or {}).items():  # the engine's page-locked memory
        out[f"pinned.{k}"] = float(v)
    return out


def engine_cost(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the timed generation cost the engine's side (``engine_counters`` deltas):
    actbus's ms per step on the engine thread, stalls, the publisher thread's CPU."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = max(1.0, d["last_step"])
    cost = {
        "steps": int(d["last_step"]),
        "capture_ms_per_step": round(1e3 * d["capture_s"] / steps, 3),
        "stall_s": round(d["stall_s"], 3),
        "publisher_cpu_ms_per_step": round(1e3 * d["publisher_cpu_s"] / steps, 3),
        "queued_mb_peak": round(after["queued_bytes_peak"] / 2**20, 1),
        "unpinned": int(d["unpinned"]),
    }
    if "pinned.num_host_alloc" in after:  # CUDA: page-locked memory grown while timed
        cost["pinned_allocs"] = int(d["pinned.num_host_alloc"])
        cost["pinned_mb"] = round(after.get("pinned.allocated_bytes.current", 0) / 2**20, 1)
        if "pinned.host_alloc_time.total" in after:  # microseconds
            cost["pinned_alloc_ms"] = round(d["pinned.host_alloc_time.total"] / 1e3, 1)
    return cost


def collector_totals() -> dict[str, float]:
    """Every front-end receiving thread's counters (``Collector.stats``: returned rows
    and returned scores), summed; ``final_wait_max_s`` is the longest. These threads
    share the GIL with vLLM's output processing."""
    from actbus.capture.returns import ReturnCollector
    from actbus.monitor.returns import ScoreCollector

    cols = [*ReturnCollector.registry.collectors.values()]
    cols += ScoreCollector.registry.collectors.values()
    out = {"recv_cpu_s": 0.0, "final_waits": 0.0, "final_wait_s": 0.0, "final_wait_max_s": 0.0}
    for c in cols:
        st = c.stats()
        for k in ("recv_cpu_s", "final_waits", "final_wait_s"):
            out[k] += st.get(k, 0.0)
        out["final_wait_max_s"] = max(out["final_wait_max_s"], st.get("final_wait_max_s", 0.0))
    return out


def all_counters(addresses: list[str]) -> dict[str, float]:
    """``engine_counters`` of several publishers (one per data-parallel rank): summed,
    but the queue's peak is the largest rank's."""
    out: dict[str, float] = {}
    for st in map(engine_counters, addresses):
        for k, v in st.items():
            out[k] = max(out.get(k, 0.0), v) if k == "queued_bytes_peak" else out.get(k, 0.0) + v
    return out


class CostMeter:
    """Where an arm's cost lies over its timed generation: made just before it, read
    (``result``) just after. The engine's side (``engine_cost``) and this front end's
    receiving threads (``collector_totals``), per engine step. Under data parallelism
    ``addresses`` are every rank's publishers: steps and seconds summed over ranks, so
    the figures are per step of one rank."""

    def __init__(self, addresses: str | list[str]) -> None:
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.before = all_counters(self.addresses)
        self.front0 = collector_totals()

    def result(self) -> dict[str, Any]:
        cost: dict[str, Any] = engine_cost(self.before, all_counters(self.addresses))
        front = collector_totals()
        cpu = front["recv_cpu_s"] - self.front0["recv_cpu_s"]
        cost["collector_cpu_ms_per_step"] = round(1e3 * cpu / max(1, cost["steps"]), 3)
        # Final outputs held back for their last rows: the receiver's lag, paid at the end.
        cost["final_wait_s"] = round(front["final_wait_s"] - self.front0["final_wait_s"], 3)
        cost["final_wait_max_s"] = round(front["final_wait_max_s"], 3)
        return cost


def cost_line(c: dict[str, Any]) -> str:
    """A ``CostMeter`` result, for the table."""
    return (
        f"per step: actbus on the engine thread {c['capture_ms_per_step']} ms, publisher "
        f"thread {c['publisher_cpu_ms_per_step']} ms CPU, front-end receiving "
        f"{c['collector_cpu_ms_per_step']} ms CPU; stalled {c['stall_s']} s; queue peak "
        f"{c.get('queued_mb_peak', 0)} MiB; pinned host grown {c.get('pinned_allocs', '-')} "
        f"times ({c.get('pinned_alloc_ms', '-')} ms), {c.get('pinned_mb', '-')} MiB; final "
        f"outputs waited {c.get('final_wait_s', 0)} s (longest {c.get('final_wait_max_s', 0)}); "
        f"{c.get('unpinned', 0)} queued messages moved out of pinned memory"
    )


FAILED: dict[str, float] = {}
"""Arms that timed out in this run (``timed_out_<arm>``: the limit, in s), for the
summary's JSON line."""


def run_arms(
    script: str,
    names: list[str],
    argv: list[str],
    plugins: Callable[[str], str | None],
    timeout: float = 900.0,
) -> dict[str, dict[str, Any]]:
    """Each arm as ``script ARGV --one NAME`` in a fresh process (a fresh engine), with
    ``VLLM_PLUGINS=plugins(name)`` (None: as it is here); its ``RESULT`` line, by arm."""
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        env = dict(os.environ)
        if (only := plugins(name)) is not None:
            env["VLLM_PLUGINS"] = only
        cmd = [sys.executable, script, *argv, "--one", name]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            # Go on with the other arms; the tail (progress bar, last log lines)
            # tells a slow arm from a stuck one.
            print(f"arm {name} timed out after {timeout:.0f} s; its output ended:", file=sys.stderr)
            for out, n in ((e.stdout, 3000), (e.stderr, 3000)):  # vLLM logs to stdout
                text = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
                print(text[-n:], file=sys.stderr)
            FAILED[f"timed_out_{name}"] = timeout
            continue
        line = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            # The root cause (a worker's) is often far above the tail: keep it all.
            log = Path(tempfile.mkdtemp(prefix="bench-arm-")) / f"{name}.log"
            log.write_text(proc.stdout + proc.stderr)
            raise SystemExit(f"arm {name} failed; its whole output: {log}")
        results[name] = json.loads(line[-1][len(RESULT) :])
        print(f"  {name:16s} {results[name]['tok_per_s']:>10.1f} tok/s", flush=True)
    return results
