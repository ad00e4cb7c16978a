"""Generation throughput with and without the web dashboard attached, in one run.

One engine (the CPU tiny Llama, layers 0 and 3, all four hooks captured) serves
the same batch of requests round after round. Rounds alternate (ABBA pairs, so a
trend in the machine's load hits both arms alike) between:

    without   no subscriber: the capture worker copies nothing (taps nobody wants)
    with      ``actbus dashboard`` attached with its default policy (``sample:5/s``)
              or ``--policy`` (its own process, started before the round and
              stopped after it), with a page's SSE stream open on it (a process
              reading ``/events``, as a page does)

Throughput is generated tokens / wall time of ``--repeat`` ``llm.generate`` calls.
The ratio is, per ABBA block, the mean of its with-rounds over the mean of its
without-rounds; the median over blocks is reported (with the ratio of the arms' medians beside it).
``--null`` adds a third arm, ``actbus run null`` with the same policy: the bus's
share of the cost, without the dashboard's own work. Beside throughput it reports
what is counted rather than timed, so it does not move with the machine's speed: the
engine thread's time in capture and the publisher thread's CPU (both from the
publisher's stats), the subscriber's and the page's CPU (from /proc), each per
second of generation. Prints a table, then one JSON line whose
``ratio_with_dashboard`` is the figure.

    flock /tmp/actbus-engine.lock python benchmarks/bench_dashboard.py [--pairs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actbus.bus.protocol import DASHBOARD_POLICY
from actbus.cli import consumer_command

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [0, 3]
PAGE = "import sys, urllib.request; [None for _ in urllib.request.urlopen(sys.argv[1] + 'events')]"
"""What an open page does to the dashboard: read its event stream (a process of its own)."""
HOOKS = ["pre_attn", "post_attn", "mlp_out", "post_block"]


def start_dashboard(
    address: str, policy: str, interval: float, log: Path, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "actbus.cli", "dashboard", "--connect", address, "--port", "0"]
    flags = ["--policy", policy, "--interval", str(interval), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(
        [*cmd, *flags],
        stdout=open(log, "wb"),  # noqa: SIM115 (lives with the process)
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"http://127\.0\.0\.1:\d+/", log.read_text(errors="replace"))
        if m:
            return proc, m.group(0)
        if proc.poll() is not None:
            raise SystemExit(f"the dashboard exited {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the dashboard did not start in 60 s:\n{log.read_text()}")


def wait_subscribed(address: str, name: str, timeout: float = 60.0) -> dict:
    from actbus.bus import Subscriber, statsview

    with Subscriber(address, statsview.stats_subscription()) as sub:
        sub.wait_welcome(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            subs = statsview.request(sub, 10)["subscribers"]
            if name in subs:
                return subs[name]
            time.sleep(0.2)
    raise SystemExit(f"{name} did not subscribe within {timeout}s")


def bus_stats(address: str) -> dict:
    """The publisher's counters (``Publisher.stats()``), over a data-less connection."""
    from actbus.bus import Subscriber, statsview

    with Subscriber(address, statsview.stats_subscription()) as sub:
        sub.wait_welcome(10)
        return statsview.request(sub, 10)


def cpu_s(proc: subprocess.Popen | None) -> float:
    """CPU seconds the process used so far (user + system), from /proc."""
    if proc is None:
        return 0.0
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4, help="ABBA pairs (2 rounds per arm each)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--output", type=int, default=384, help="new tokens per request")
    ap.add_argument(
        "--repeat", type=int, default=3, help="generate calls per round (longer rounds: less noise)"
    )
    ap.add_argument(
        "--policy", default=DASHBOARD_POLICY, help=f"the dashboard's (default {DASHBOARD_POLICY})"
    )
    ap.add_argument(
        "--null", action="store_true", help="a third arm: `actbus run null` with the same policy"
    )
    ap.add_argument("--dtype", help="engine dtype (default: bfloat16 on a GPU, else float32)")
    ap.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds idle before every round (after subscribing, for the arms with one)",
    )
    ap.add_argument("--no-page", action="store_true", help="no SSE client on the dashboard")
    ap.add_argument(
        "--dash-flag", action="append", default=[], help="one more flag for the dashboard"
    )
    ap.add_argument("--interval", type=float, default=1.0, help="the dashboard's --interval")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from actbus.tiny_models import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    address = f"ipc://{tmp}/bus.sock"
    t0 = time.monotonic()
    llm = LLM(
        str(build_tiny_model("llama")),
        dtype=args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"),
        gpu_memory_utilization=0.3,  # on CPU: the share of host memory it reserves
        max_model_len=512,
        max_num_seqs=args.prompts,
        num_gpu_blocks_override=128,
        enable_prefix_caching=False,
        seed=0,
        additional_config={"actbus": {"publish": address, "layers": LAYERS, "hooks": HOOKS}},
    )
    start_s = time.monotonic() - t0
    prompts = [
        TokensPrompt(prompt_token_ids=[(17 * i + 5 * j) % 900 + 10 for j in range(32 + i)])
        for i in range(args.prompts)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True, detokenize=False)

    def round_() -> tuple[float, int]:
        t = time.monotonic()
        tokens = 0
        for _ in range(args.repeat):
            outs = llm.generate(prompts, sp, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return time.monotonic() - t, tokens

    round_()  # warm-up (compile, caches)
    arms = ["without", "with"] + (["null"] if args.null else [])
    order = [*arms, *reversed(arms)] * args.pairs
    rows: list[dict] = []
    for i, arm in enumerate(order):
        proc = page = None
        name = {"with": "dashboard", "null": "null"}.get(arm, "")
        if arm == "with":
            proc, url = start_dashboard(
                address, args.policy, args.interval, tmp / f"dash-{i}.log", args.dash_flag
            )
            page = None if args.no_page else subprocess.Popen([sys.executable, "-c", PAGE, url])
        elif arm == "null":
            proc = subprocess.Popen(
                consumer_command(
                    "null", address, "--policy", args.policy, "--log-level", "WARNING"
                ),
                stdout=subprocess.DEVNULL,
                cwd=ROOT,
            )
        if proc is not None:
            wait_subscribed(address, name)
        # Every arm idles as long before and after its round: on the VM a round that
        # follows a pause runs faster than one that follows a round, so pauses only
        # around the subscriber's rounds would favour them.
        time.sleep(args.settle)  # and start-up work (imports, first report) is done
        before = bus_stats(address)
        cpu0, page0 = cpu_s(proc), cpu_s(page)
        dt, tokens = round_()
        cpu1, page1 = cpu_s(proc), cpu_s(page)
        after = bus_stats(address)
        row = {"round": i, "arm": arm, "gen_s": round(dt, 3), "tokens": tokens}
        row["tok_per_s"] = round(tokens / dt, 1)
        # What the bus cost the engine's process, counted by the publisher itself: the
        # engine thread's time in capture, and the publisher thread's CPU.
        for key in ("capture_s", "publisher_cpu_s"):
            row[key] = round(after.get(key, 0.0) - before.get(key, 0.0), 4)
        time.sleep(1.5)  # lets a subscriber acknowledge what it got
        if proc is not None:
            row["consumer_cpu_s"] = round(cpu1 - cpu0, 3)
            row["page_cpu_s"] = round(page1 - page0, 3)
            view = bus_stats(address)["subscribers"].get(name, {})
            row["received"] = view.get("sent", 0)
            row["dropped"] = sum((view.get("dropped") or {}).values())
            if page is not None:
                page.terminate()
                page.wait(timeout=10)
            rc = stop(proc)
            if rc != 0 or not row["received"]:
                raise SystemExit(f"round {i}: {name} rc={rc}, got nothing: {view}")
        rows.append(row)
        extra = (
            f"  {name} got {row['received']} msgs, dropped {row['dropped']}, "
            f"used {row['consumer_cpu_s']:.2f} CPU s"
            if proc is not None
            else ""
        )
        print(
            f"round {i:2d}  {arm:8s}  {row['tok_per_s']:8.1f} tok/s  {dt:6.2f} s  capture "
            f"{1000 * row['capture_s']:6.1f} ms, publisher {1000 * row['publisher_cpu_s']:6.1f} "
            f"ms CPU{extra}",
            flush=True,
        )
    llm.llm_engine.engine_core.shutdown()

    per = {a: [r["tok_per_s"] for r in rows if r["arm"] == a] for a in arms}
    med = {a: statistics.median(v) for a, v in per.items()}
    blocks = [rows[i : i + 2 * len(arms)] for i in range(0, len(rows), 2 * len(arms))]

    def block_ratio(arm: str) -> float:
        """Median over ABBA blocks of mean(arm) / mean(without) within the block: load
        that drifts across the run hits both arms of a block alike."""
        return statistics.median(
            statistics.mean(r["tok_per_s"] for r in b if r["arm"] == arm)
            / statistics.mean(r["tok_per_s"] for r in b if r["arm"] == "without")
            for b in blocks
        )

    ratio = block_ratio("with")
    null_ratio = block_ratio("null") if "null" in arms else None

    def share(arm: str, key: str, cores: int = 1) -> float:
        """Median over the arm's rounds of ``key`` (CPU or thread seconds) per second
        of generation, over ``cores`` (the whole machine: os.cpu_count())."""
        vals = [r[key] / r["gen_s"] / cores for r in rows if r["arm"] == arm and key in r]
        return statistics.median(vals) if vals else 0.0

    # Counted, not timed: the shares of the round that actbus's engine-side code (the
    # engine thread in capture, the publisher thread's CPU) and the subscriber's own
    # processes took. Unlike throughput, these do not move with the machine's speed.
    cpus = os.cpu_count() or 1
    shares = {
        a: {
            "capture": share(a, "capture_s"),
            "publisher_cpu": share(a, "publisher_cpu_s"),
            "consumer_cpu_of_machine": share(a, "consumer_cpu_s", cpus),
            "page_cpu_of_machine": share(a, "page_cpu_s", cpus),
        }
        for a in arms
    }
    engine_side = {
        a: shares[a]["capture"]
        + shares[a]["publisher_cpu"]
        - shares["without"]["capture"]
        - shares["without"]["publisher_cpu"]
        for a in arms
        if a != "without"
    }
    print()
    print(
        f"{'arm':10s} {'median tok/s':>14s} {'min':>10s} {'max':>10s} {'rounds':>7s}"
        f" {'capture':>9s} {'pub CPU':>9s} {'sub CPU':>9s} {'page CPU':>9s}"
    )
    for a in arms:
        sh = shares[a]
        print(
            f"{a:10s} {med[a]:14.1f} {min(per[a]):10.1f} {max(per[a]):10.1f} {len(per[a]):7d}"
            f" {sh['capture']:9.2%} {sh['publisher_cpu']:9.2%}"
            f" {sh['consumer_cpu_of_machine']:9.2%} {sh['page_cpu_of_machine']:9.2%}"
        )
    print(
        "(capture: the engine thread's time in actbus, per second of generation; pub CPU: "
        "the publisher thread's; sub and page CPU: of the whole machine)"
    )
    for a, v in engine_side.items():
        print(f"engine-side cost of {a}: {v:.2%} of the engine's time (over without)")
    print(
        f"ratio_with_dashboard = {ratio:.3f} (median of {len(blocks)} ABBA blocks; "
        f"ratio of medians {med['with'] / med['without']:.3f}; target >= 0.97)"
    )
    if null_ratio is not None:
        print(f"ratio_with_null_sampler = {null_ratio:.3f}")
    load = os.getloadavg()
    summary = {
        "ratio_with_dashboard": round(ratio, 4),
        "ratio_of_medians": round(med["with"] / med["without"], 4),
        "ratio_with_null_sampler": None if null_ratio is None else round(null_ratio, 4),
        "median_tok_per_s": {a: round(v, 1) for a, v in med.items()},
        "engine_side_cost": {a: round(v, 5) for a, v in engine_side.items()},
        "shares": {a: {k: round(v, 5) for k, v in sh.items()} for a, sh in shares.items()},
        "policy": args.policy,
        "dashboard_flags": args.dash_flag,
        "page": not args.no_page,
        "prompts": args.prompts,
        "output_tokens": args.output,
        "repeat": args.repeat,
        "taps": len(LAYERS) * len(HOOKS),
        "engine_start_s": round(start_s, 1),
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "loadavg_1m_at_end": round(load[0], 2),
        "rounds": rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
