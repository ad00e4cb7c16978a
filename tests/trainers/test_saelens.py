"""Checkpoints that SAELens reads exactly: four SAEs (topk, batchtopk, relu, jumprelu, one
on each hook of layer 3) train live from the tiny Llama engine through the real data
module, are saved by the trainer's own callback, and ``sae_lens.SAE.load_from_disk``,
given the directory unedited, encodes and reconstructs the engine's rows as actbus's
module does, to float32 precision.

The tolerance: every latent and reconstruction within ``RTOL * |value| + ATOL * max|x|``
of actbus's, RTOL = 1e-5 and ATOL = 4e-6 (about 32 float32 ulps of the largest
activation): the fold rounds each weight once, and the two compute ``pre`` in a different
order. Measured on the tiny Llama: at most 6e-7 * max|x|. The same rounding can put a
latent that sits on its gate (a JumpReLU threshold, ReLU's zero, a row's k-th value) on
either side of it: such a flip is allowed only where the latent is within that tolerance
of its gate, in at most one row in a hundred, and those rows are left out of the value
comparison (a flip moves a latent by its whole threshold). CI once saw one on jumprelu.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from actbus.bus import Subscription
from tests.support.recorder import RowRecorder
from trainers.callbacks import SaveSAEs
from trainers.checkpoint import load_sae
from trainers.config import DataConfig, SAEConfig
from trainers.data import ActivationDataModule
from trainers.sae_module import SAETrainer

pytestmark = pytest.mark.engine
LAYER = 3
# Each kind on its own hook, so every TransformerLens name is checked too.
KINDS = {
    "topk": ("post_block", "blocks.3.hook_resid_post"),
    "batchtopk": ("pre_attn", "blocks.3.hook_resid_pre"),
    "relu": ("post_attn", "blocks.3.hook_resid_mid"),
    "jumprelu": ("mlp_out", "blocks.3.hook_mlp_out"),
}
ARCH = {"topk": "topk", "batchtopk": "jumprelu", "relu": "standard", "jumprelu": "jumprelu"}
RTOL, ATOL = 1e-5, 4e-6


def _prompts(n: int) -> list[str]:
    words = ["river", "stone", "seven", "blue", "quickly", "under", "market", "song", "why"]
    return [
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 13)) for i in range(n)
    ]


def _train_live(engine, out: Path) -> tuple[SAETrainer, ActivationDataModule]:
    """Fit the four SAEs from the engine's stream while it serves a round of prompts."""
    from vllm import SamplingParams

    configs = [
        SAEConfig(d_in=128, kind=kind, expansion=4, k=8, layer=LAYER, hook=hook, lr=1e-3)
        for kind, (hook, _) in KINDS.items()
    ]
    data = DataConfig(
        streams=tuple((LAYER, hook) for hook, _ in KINDS.values()),
        address=engine.address,
        policy="block",
        batch_tokens=128,
        buffer_tokens=2048,
        warmup_tokens=256,
        idle_s=4,
        name="saelens-test",
    )
    module, dm = SAETrainer(configs), ActivationDataModule(data)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        callbacks=[SaveSAEs(out, every_steps=0)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit(module, datamodule=dm)
        except BaseException as e:  # raised in the test's thread below
            failed.append(e)

    with warnings.catch_warnings():
        # Warnings of actbus's own code (non-writable arrays, grad-carrying scalars) fail.
        warnings.filterwarnings("error", module="trainers")
        t = threading.Thread(target=fit, name="fit")
        t.start()
        deadline = time.monotonic() + 60
        while not (dm.stream and dm.stream.source and dm.stream.source.welcomed.is_set()):
            assert time.monotonic() < deadline and t.is_alive(), failed or "no subscription"
            time.sleep(0.1)
        params = SamplingParams(max_tokens=16, temperature=0)  # a per-request seed kills vLLM-CPU
        engine.llm.generate(_prompts(48), params, use_tqdm=False)
        t.join(timeout=180)
    assert not t.is_alive() and not failed, failed
    assert trainer.global_step > 5
    return module, dm


def _gate(kind: str, sae, z_other: torch.Tensor) -> torch.Tensor:
    """The value a latent must pass to fire, broadcast to ``z``'s shape."""
    if kind == "jumprelu":
        return sae.log_threshold.detach().exp().expand_as(z_other)
    if kind == "batchtopk":
        return sae.threshold.detach().expand_as(z_other)
    if kind == "topk":  # the weakest latent the other side kept on the row
        low = z_other.masked_fill(z_other <= 0, torch.inf).amin(1, keepdim=True)
        return low.expand_as(z_other)
    return torch.zeros_like(z_other)


def _same_active_set(kind: str, sae, z: torch.Tensor, z_sl: torch.Tensor, atol: float):
    """Rows whose active latents agree; fails on a flip that is not a rounding at its gate."""
    flip = (z > 0) != (z_sl > 0)
    if flip.any():
        value = torch.where(z > 0, z, z_sl)[flip]  # the side where it fired
        gate = torch.where(z > 0, _gate(kind, sae, z_sl), _gate(kind, sae, z))[flip]
        off = (value - gate).abs()
        print(f"\n{kind}: {int(flip.sum())} latents flipped, "
              f"at most {float(off.max()):.2e} from their gate")  # fmt: skip
        assert bool((off <= RTOL * value.abs() + atol).all()), (
            f"{kind}: a different set of active latents, {off.max():.3e} from the gate"
        )
    steady = ~flip.any(1)
    assert steady.float().mean() >= 0.99, f"{kind}: {int((~steady).sum())} rows flipped"
    return steady


def test_saelens_loads_every_kind_to_the_same_latents(sched_engine, tmp_path):
    from sae_lens import SAE

    recorder = RowRecorder(sched_engine.address, Subscription(layers=(LAYER,), window=1024))
    try:
        module, dm = _train_live(sched_engine, tmp_path / "out")
    finally:
        recorder.close()
    rows = {hook: [] for hook, _ in KINDS.values()}
    for (_, _, _, hook), r in recorder.rows.items():
        rows[hook] += r.acts
    model = str(sched_engine.model_path)
    for kind, (hook, tl_name) in KINDS.items():
        x = torch.cat(rows[hook]).float()
        assert len(x) > 500, (hook, len(x))
        sae = module.sae(next(c.name for c in module.configs if c.kind == kind)).eval()
        path = tmp_path / "out" / sae.cfg.name
        cfg = json.loads((path / "cfg.json").read_text())
        assert cfg["architecture"] == ARCH[kind]
        assert cfg["metadata"]["hook_name"] == tl_name
        assert cfg["metadata"]["model_name"] == model
        assert cfg["metadata"]["context_size"] == dm.stream.hub.max_position + 1 > 16

        loaded = SAE.load_from_disk(path)
        assert loaded.cfg.metadata.hook_name == tl_name  # read as a 6.x config, kept
        assert loaded.cfg.metadata.model_name == model
        with torch.no_grad():
            z, z_sl = sae.encode(x), loaded.encode(x)
            r, r_sl = sae(x), loaded(x)
        scale = float(x.abs().max())
        steady = _same_active_set(kind, sae, z, z_sl, ATOL * scale)
        assert (z > 0).any(1).float().mean() > 0.5, f"{kind}: hardly anything fires"
        torch.testing.assert_close(z_sl[steady], z[steady], rtol=RTOL, atol=ATOL * scale)
        torch.testing.assert_close(r_sl[steady], r[steady], rtol=RTOL, atol=ATOL * scale)
        err = float((r - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
        print(f"\n{kind} on {hook}: {len(x)} rows, fvu {err:.3f}, max |dz| "
              f"{float((z - z_sl).abs().max()):.2e}, max |dr| {float((r - r_sl).abs().max()):.2e}"
              f", max |x| {scale:.2f}")  # fmt: skip
        # actbus's own loader rebuilds the module to the same precision.
        again = load_sae(path).eval()
        with torch.no_grad():
            steady = _same_active_set(kind, sae, z, again.encode(x), ATOL * scale)
            torch.testing.assert_close(again(x)[steady], r[steady], rtol=RTOL, atol=ATOL * scale)
