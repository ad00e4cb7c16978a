"""TopK SAE training throughput: the trainer against a minimal plain-PyTorch step.

    python benchmarks/bench_sae.py                       # GPU: d=4096, 16x, k=64, bf16 inputs
    python benchmarks/bench_sae.py --device cpu --d 256 --expansion 4 --k 16 --tokens 32768

Paths, all on the same bf16 input batches, each timed over ``--tokens`` tokens
after ``--warmup`` steps:

- ``baseline``: written here, minimally: encoder matmul, ReLU, topk, a dense
  ``[tokens, d_sae]`` code times the decoder, MSE, backward, Adam.
- ``module``: the trainer's own step (``SparseAutoencoder.training_loss``: sparse
  gather decoder, AuxK, dead-latent counters, decoder-norm projection), no Lightning.
- ``lightning``: ``SAETrainer`` under ``lightning.Trainer.fit`` on batches already in
  memory (skipped, and said so, where Lightning is not installed).
- ``bus`` (``--bus``): the whole data path: a publisher process sends the batches over
  an ipc socket, the trainer's DataModule receives, shuffles and batches them, and
  Lightning trains on them.

Both the baseline and the trainer run under the same ``--precision`` (bf16 autocast
on GPU by default, fp32 weights either way). Prints a table; the last line is JSON
with ``ratio_vs_baseline`` (headline path / baseline), ``tokens_per_s`` (headline
path: ``bus`` with ``--bus``, else ``lightning``) and every figure. Needs only this
repository, torch and (optionally) lightning; ``--bus`` also pyzmq.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainers.config import SAEConfig  # noqa: E402
from trainers.optim import adam  # noqa: E402
from trainers.sae import SparseAutoencoder  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _autocast(device: str, precision: str):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_batches(n: int, tokens: int, d: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Sparse-ish synthetic rows (bf16), distinct per batch, made once up front on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_atoms = 4 * d
    atoms = torch.randn(n_atoms, d, generator=g, device=device)
    atoms = torch.nn.functional.normalize(atoms, dim=1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, n_atoms, (tokens, 8), generator=g, device=device)
        coef = torch.rand(tokens, 8, generator=g, device=device)
        z = torch.zeros(tokens, n_atoms, device=device).scatter_(1, idx, coef)
        out.append((z @ atoms).to(torch.bfloat16))
    return out


class BaselineTopK(torch.nn.Module):
    """The plain PyTorch TopK SAE step the trainer is measured against."""

    def __init__(self, d: int, n: int, k: int) -> None:
        super().__init__()
        self.k = k
        w = torch.nn.functional.normalize(torch.randn(n, d), dim=1)
        self.W_dec = torch.nn.Parameter(w)
        self.W_enc = torch.nn.Parameter(w.t().clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(n))
        self.b_dec = torch.nn.Parameter(torch.zeros(d))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        pre = torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
        v, i = pre.topk(self.k, dim=-1)
        z = torch.zeros_like(pre).scatter(-1, i, v)
        x_hat = z @ self.W_dec + self.b_dec
        return (x_hat - x).pow(2).sum(-1).mean()


def time_steps(step, batches: list[torch.Tensor], warmup: int, device: str) -> dict[str, float]:
    for x in batches[:warmup]:
        step(x)
    _sync(device)
    t0 = time.perf_counter()
    for x in batches[warmup:]:
        step(x)
    _sync(device)
    dt = time.perf_counter() - t0
    toks = sum(int(x.shape[0]) for x in batches[warmup:])
    return {"tokens_per_s": toks / dt, "ms_per_step": 1e3 * dt / max(1, len(batches) - warmup)}


def bench_baseline(a, batches) -> dict[str, float]:
    torch.manual_seed(0)
    m = BaselineTopK(a.d, a.d * a.expansion, a.k).to(a.device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)

    def step(x):
        with _autocast(a.device, a.precision):
            loss = m.loss(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return time_steps(step, batches, a.warmup, a.device)


def _cfg(a) -> SAEConfig:
    return SAEConfig(
        d_in=a.d, expansion=a.expansion, k=a.k, kind="topk", lr=1e-4, decoder=a.decoder
    )


def _module_step(a, batches):
    """The trainer's own step without Lightning, on a fresh SAE: a function of a batch."""
    sae = SparseAutoencoder(_cfg(a)).to(a.device)
    sae.initialize(batches[0])
    opt = adam(sae.parameters(), lr=1e-4)

    def step(x):
        with _autocast(a.device, a.precision):
            loss = sae.training_loss(x)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.remove_parallel_grad()
        opt.step()
        sae.normalize_decoder()

    return step


def bench_module(a, batches) -> dict[str, float]:
    return time_steps(_module_step(a, batches), batches, a.warmup, a.device)


def _pl_trainer(a, callbacks):
    import lightning.pytorch as pl

    return pl.Trainer(
        max_epochs=1,
        accelerator="gpu" if a.device.startswith("cuda") else "cpu",
        devices=1,
        precision=a.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def _timer(a, n_tokens_per_step: int):
    import lightning.pytorch as pl

    class Timer(pl.Callback):
        """Times steps ``warmup..end`` (Lightning's own start-up is not counted)."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.t1 = 0.0
            self.steps = 0
            self.tokens = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == a.warmup:
                _sync(a.device)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= a.warmup:
                self.steps += 1
                self.tokens += sum(int(v["activation"].shape[0]) for v in batch.values())

        def on_train_end(self, trainer, pl_module) -> None:
            _sync(a.device)
            self.t1 = time.perf_counter()

        def result(self) -> dict[str, float]:
            dt = self.t1 - self.t0
            return {
                "tokens_per_s": self.tokens / dt,
                "ms_per_step": 1e3 * dt / max(1, self.steps),
                "steps": self.steps,
            }

    return Timer()


def bench_lightning(a, batches) -> dict[str, float]:
    from trainers.sae_module import SAETrainer

    cfg = _cfg(a)
    key = cfg.stream
    data = [{key: {"activation": x}} for x in batches]
    timer = _timer(a, a.batch_tokens)
    callbacks = [timer] + ([_profiler_callback(a)] if a.profile else [])
    _pl_trainer(a, callbacks).fit(SAETrainer([cfg]), train_dataloaders=_Listed(data))
    return timer.result()


PROFILED_STEPS = 4
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@contextlib.contextmanager
def _sync_debug(a, label: str):
    """CUDA's sync debugging on for the block: prints each op that made the host wait."""
    if not a.device.startswith("cuda"):
        yield
        return
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in seen:
        if "synchroniz" in str(w.message):
            print(f"sync ({label}): {w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}")


def _profile_table(prof, title: str) -> None:
    """Where a step's device time goes, and how often the host waited for the device."""
    events = prof.key_averages()
    print(f"--- profile: {title} ({PROFILED_STEPS} steps) ---")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    syncs = {e.key: e.count for e in events if e.key in SYNC_CALLS or "DtoH" in e.key}
    per_step = {k: v / PROFILED_STEPS for k, v in syncs.items()}
    print(f"host waits per step: {per_step or 'none'}")


def _profiler(a):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    return profile(activities=acts)


def profile_module(a, batches) -> None:
    """``--profile``: the module's step under torch.profiler, after a warm-up."""
    step = _module_step(a, batches)
    for x in batches[: a.warmup]:
        step(x)
    with _sync_debug(a, "module"):
        step(batches[a.warmup])
    _sync(a.device)
    with _profiler(a) as prof:
        for x in batches[a.warmup : a.warmup + PROFILED_STEPS]:
            step(x)
        _sync(a.device)
    _profile_table(prof, "module")


def _profiler_callback(a):
    import lightning.pytorch as pl

    class Profiled(pl.Callback):
        """torch.profiler around steps ``warmup .. warmup + PROFILED_STEPS``."""

        def __init__(self) -> None:
            self.prof = None
            self.debug = _sync_debug(a, "lightning")  # around step warmup - 1

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == a.warmup - 1:
                self.debug.__enter__()
            if batch_idx == a.warmup:
                _sync(a.device)
                self.prof = _profiler(a)
                self.prof.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == a.warmup - 1:
                self.debug.__exit__(None, None, None)
            if self.prof is not None and batch_idx == a.warmup + PROFILED_STEPS - 1:
                _sync(a.device)
                self.prof.__exit__(None, None, None)
                _profile_table(self.prof, "lightning")
                self.prof = None

    return Profiled()


class _Listed(torch.utils.data.IterableDataset):
    def __init__(self, items) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def bench_bus(a) -> dict[str, float]:
    """Publisher process -> ipc -> the trainer's DataModule -> Lightning."""
    from trainers.config import DataConfig
    from trainers.data import ActivationDataModule
    from trainers.sae_module import SAETrainer

    steps = a.warmup + a.tokens // a.batch_tokens
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/bench.sock"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        pub = subprocess.Popen(
            [sys.executable, __file__, "--publish", address, "--d", str(a.d),
             "--batch-tokens", str(a.batch_tokens), "--messages", str(steps + 8)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        try:
            assert pub.stdout.readline().strip() == "ready"
            cfg = _cfg(a)
            data = DataConfig(
                streams=((0, "post_block"),),
                address=address,
                policy="block",
                batch_tokens=a.batch_tokens,
                buffer_tokens=8 * a.batch_tokens,
                warmup_tokens=2 * a.batch_tokens,
                max_tokens=steps * a.batch_tokens,
                idle_s=30,
            )
            timer = _timer(a, a.batch_tokens)
            dm = ActivationDataModule(data)
            _pl_trainer(a, [timer]).fit(SAETrainer([cfg]), datamodule=dm)
            out = timer.result()
            out["missed"] = dm.stats().get("bus/missed", 0)
            return out
        finally:
            pub.kill()
            pub.wait(timeout=10)


def publish(address: str, d: int, batch_tokens: int, messages: int) -> None:
    """The --bus publisher: bf16 batches, as fast as the trainer takes them."""
    import numpy as np

    from actbus.bus import Publisher
    from actbus.wire import Header, RowIndex

    pub = Publisher(address, info={"model": "bench", "hidden_size": d}, queue_bytes=1 << 30)
    print("ready", flush=True)
    while not pub.stats()["subscribers"]:
        time.sleep(0.01)
    x = make_batches(4, batch_tokens, d, "cpu", seed=1)
    ri = RowIndex(
        ["bench"], np.array([0, batch_tokens]), np.arange(batch_tokens), np.zeros(batch_tokens)
    )
    for step in range(messages):
        hdr = Header(step, 0, "post_block", "bfloat16", (batch_tokens, d), "bench", ri)
        pub.publish(hdr, x[step % 4])
    pub.close(timeout=600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--expansion", type=int, default=16)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1 << 20, help="timed tokens per path")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--precision", default=None, help="bf16-mixed (GPU default) or 32-true")
    p.add_argument("--bus", action="store_true", help="also time the data path from a bus")
    p.add_argument("--decoder", default="sparse", choices=["sparse", "dense"], help="SAE decode")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print where the module's and Lightning's steps spend device time (the "
        "Lightning path's timing then includes the profiler: read its ratio with care)",
    )
    p.add_argument("--publish", help=argparse.SUPPRESS)
    p.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.publish:
        return publish(a.publish, a.d, a.batch_tokens, a.messages)
    a.precision = a.precision or ("bf16-mixed" if a.device.startswith("cuda") else "32-true")
    torch.manual_seed(0)
    n_batches = a.warmup + max(1, a.tokens // a.batch_tokens)
    batches = make_batches(n_batches, a.batch_tokens, a.d, a.device)
    res: dict[str, dict[str, float]] = {}
    res["baseline"] = bench_baseline(a, batches)
    res["module"] = bench_module(a, batches)
    if a.profile:
        profile_module(a, batches)
    try:
        import lightning  # noqa: F401

        have_pl = True
    except ImportError:
        have_pl = False
        print("lightning is not installed: timing the module's step only (no Lightning paths)")
    if have_pl:
        res["lightning"] = bench_lightning(a, batches)
        if a.bus:
            res["bus"] = bench_bus(a)
    # The headline is the most complete path measured: the bus's when asked for.
    head = ("bus" if a.bus else "lightning") if have_pl else "module"
    base = res["baseline"]["tokens_per_s"]
    print(f"TopK SAE d={a.d} d_sae={a.d * a.expansion} k={a.k} batch={a.batch_tokens} "
          f"inputs=bf16 precision={a.precision} device={a.device}")  # fmt: skip
    print(f"{'path':<10} {'tokens/s':>12} {'ms/step':>9} {'vs baseline':>12}")
    for name, r in res.items():
        r["ratio_vs_baseline"] = r["tokens_per_s"] / base
        print(
            f"{name:<10} {r['tokens_per_s']:>12,.0f} {r['ms_per_step']:>9.2f} "
            f"{r['ratio_vs_baseline']:>11.2f}x"
        )
    summary = {
        "ratio_vs_baseline": res[head]["tokens_per_s"] / base,
        "tokens_per_s": res[head]["tokens_per_s"],
        "headline_path": head,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "config": {
            "decoder": a.decoder,
            "d": a.d,
            "d_sae": a.d * a.expansion,
            "k": a.k,
            "batch_tokens": a.batch_tokens,
            "tokens": a.tokens,
            "precision": a.precision,
            "inputs": "bfloat16",
        },
        "paths": res,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
