"""Monitor sources for the shared Llama engine, made with the trainers' own code and
with SAELens' own.

A probe (trained a few steps on the tiny model's own stream) and three SAEs (ReLU,
JumpReLU, TopK) are written with ``save_probe``/``save_sae`` before the engine starts,
and the engine's ``actbus.monitor`` entry points at them. The oracle is the trainers'
own modules loaded back (``load_probe``, ``load_sae``) applied to HF transformers'
hidden states, so the engine's folding of the checkpoints is checked, not assumed.

Three more SAEs (standard, JumpReLU, TopK: ``SAELENS_SPECS``) are saved by SAELens
itself (``SAE.save_model``), each naming its stream as SAELens users do
(``SAELENS_HOOK_NAMES``); their oracle is SAELens' ``encode``
(tests/monitor/test_monitor_saelens.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from actbus.monitor.reader import ScoreReader, ScoreStep

# (name, kind, layers, hook, features): one monitor of each kind, at every hook point.
RAW_WEIGHT_SEED = 7


@dataclass(frozen=True)
class MonitorSpec:
    name: str
    kind: str  # "probe" | "relu" | "jumprelu" | "topk" | "weight"
    layers: tuple[int, ...]
    hook: str
    features: tuple[int, ...] = ()


SPECS = (
    MonitorSpec("probe", "probe", (1, 3), "post_block"),
    MonitorSpec("sae_relu", "relu", (2,), "post_attn", (0, 5, 9, 31)),
    MonitorSpec("sae_jump", "jumprelu", (1,), "mlp_out", (3, 4, 17)),
    MonitorSpec("sae_topk", "topk", (0,), "pre_attn", (1, 2, 3, 40, 63)),
    MonitorSpec("raw", "weight", (2,), "post_block"),
)
D_SAE = 64
# SAEs saved by SAELens, at points the engine also captures (layers 0 and 3), so their
# scores are checked against SAELens' encode of the engine's own rows.
SAELENS_SPECS = (
    MonitorSpec("sl_standard", "standard", (3,), "post_block", (0, 5, 9, 31)),
    MonitorSpec("sl_jumprelu", "jumprelu", (0,), "mlp_out", (0, 1, 2, 3, 17, 40)),
    MonitorSpec("sl_topk", "topk", (3,), "post_attn", (1, 2, 3, 40, 63)),
)
SAELENS_HOOK_NAMES = {
    "sl_standard": "model.layers.3",  # a Hugging Face module name
    "sl_jumprelu": "blocks.0.hook_mlp_out",  # TransformerLens names
    "sl_topk": "blocks.3.hook_resid_mid",
}


def save_saelens_sae(
    out: Path,
    arch: str,
    stream: torch.Tensor,
    hook_name: str | None,
    *,
    d_sae: int = D_SAE,
    seed: int = 0,
    **cfg,
):
    """An SAELens SAE of architecture ``arch`` (standard, jumprelu, topk), its weights
    drawn so that about half its latents fire on ``stream`` [tokens, d_in], saved by
    SAELens' own ``save_model`` into ``out``; returns the SAE. JumpReLU: some
    thresholds are negative (SAELens gates ``relu(pre)``); TopK: k=4 and decoder rows
    of different norms (``cfg``: e.g. ``rescale_acts_by_decoder_norm``)."""
    from sae_lens import (
        JumpReLUSAE,
        JumpReLUSAEConfig,
        StandardSAE,
        StandardSAEConfig,
        TopKSAE,
        TopKSAEConfig,
    )
    from sae_lens.saes.sae import SAEMetadata

    classes = {
        "standard": (StandardSAE, StandardSAEConfig, {}),
        "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig, {}),
        "topk": (TopKSAE, TopKSAEConfig, {"k": 4}),
    }
    cls, cfg_cls, kw = classes[arch]
    x = stream.float()
    d_in = x.shape[1]
    meta = SAEMetadata(hook_name=hook_name, model_name="tiny-llama")
    sae = cls(cfg_cls(d_in=d_in, d_sae=d_sae, metadata=meta, **{**kw, **cfg}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sae.b_dec.copy_(x.mean(0))
        w = torch.randn(d_in, d_sae, generator=g) / (x - x.mean(0)).norm(dim=1).mean()
        sae.W_enc.copy_(w)
        pre = (x - x.mean(0)) @ w
        sae.b_enc.copy_(-pre.median(0).values + 0.1 * pre.std(0) * torch.randn(d_sae, generator=g))
        sae.W_dec.copy_(
            torch.randn(d_sae, d_in, generator=g) * (0.5 + torch.rand(d_sae, 1, generator=g))
        )
        if arch == "jumprelu":
            theta = 0.3 * pre.std(0) * torch.rand(d_sae, generator=g)
            theta[::3] = -0.5 * pre.std(0)[::3]  # negative: relu(pre) still gates them at 0
            sae.threshold.copy_(theta)
    sae.save_model(out)
    return sae


def build_saelens_sources(model_path: Path, out: Path) -> dict:
    """Save ``SAELENS_SPECS``' SAEs with SAELens under ``out``; their monitor entries."""
    monitors = {}
    for i, s in enumerate(SAELENS_SPECS):
        extra = {"rescale_acts_by_decoder_norm": True} if s.kind == "topk" else {}
        stream = _stream(model_path, s.layers[0], s.hook)
        save_saelens_sae(out / s.name, s.kind, stream, SAELENS_HOOK_NAMES[s.name], seed=i, **extra)
        monitors[s.name] = {
            "sae": str(out / s.name),
            "features": list(s.features),
            "layers": list(s.layers),
            "hook": s.hook,
        }
    return monitors


def _stream(model_path: Path, layer: int, hook: str) -> torch.Tensor:
    from tests.support.oracle import hf_activations

    gen = torch.Generator().manual_seed(layer)
    ids = torch.randint(3, 400, (160,), generator=gen).tolist()
    return hf_activations(model_path, ids, [layer], [hook])[(layer, hook)]


def build_monitor_sources(
    model_path: Path, out: Path, hidden: int, *, saelens: bool = True
) -> dict:
    """Write the checkpoints under ``out``; returns the engine's ``actbus.monitor`` entry.
    ``saelens``: also the SAEs saved by SAELens itself (the GPU image has no SAELens)."""
    from trainers.checkpoint import save_probe, save_sae
    from trainers.config import ProbeConfig, SAEConfig
    from trainers.linear_probe import LinearProbe
    from trainers.sae import SparseAutoencoder

    monitors: dict[str, dict] = {}
    for s in SPECS:
        where = str(out / s.name)
        if s.kind == "probe":
            x = _stream(model_path, s.layers[0], s.hook)
            probe = LinearProbe(ProbeConfig(d_in=hidden, layer=s.layers[0], hook=s.hook))
            probe.initialize(x)
            y = (x[:, 0] > x[:, 0].median()).float()[:, None]  # a label the stream carries
            opt = torch.optim.Adam(probe.parameters(), lr=0.05)
            for _ in range(30):
                opt.zero_grad()
                torch.nn.functional.binary_cross_entropy_with_logits(probe(x), y).backward()
                opt.step()
            save_probe(probe, where)
            monitors[s.name] = {"probe": where, "layers": list(s.layers), "hook": s.hook}
        elif s.kind == "weight":
            gen = torch.Generator().manual_seed(RAW_WEIGHT_SEED)
            w = (torch.randn(hidden, generator=gen) / hidden**0.5).tolist()
            monitors[s.name] = {
                "weight": w,
                "bias": 0.25,
                "layers": list(s.layers),
                "hook": s.hook,
            }
        else:
            cfg = SAEConfig(
                d_in=hidden, kind=s.kind, d_sae=D_SAE, k=4, layer=s.layers[0], hook=s.hook
            )
            sae = SparseAutoencoder(cfg)
            sae.initialize(_stream(model_path, s.layers[0], s.hook))  # scale folded on save
            with torch.no_grad():
                gen = torch.Generator().manual_seed(len(s.name))
                sae.b_enc.copy_(0.3 * torch.randn(D_SAE, generator=gen))
            save_sae(sae, where)
            monitors[s.name] = {
                "sae": where,
                "features": list(s.features),
                "layers": list(s.layers),
                "hook": s.hook,
            }
    if saelens:
        monitors.update(build_saelens_sources(model_path, out))
    return {"monitors": monitors}


def expected_scores(spec: MonitorSpec, source: dict, stream: torch.Tensor) -> torch.Tensor:
    """``[tokens, width]``: what the trainer's own module reads off ``stream``."""
    from trainers.checkpoint import load_probe, load_sae

    x = stream.float()
    with torch.no_grad():
        if spec.kind == "probe":
            return torch.sigmoid(load_probe(source["probe"])(x))
        if spec.kind == "weight":
            w = torch.tensor(source["weight"], dtype=torch.float32)
            return (x @ w + source["bias"])[:, None]
        return load_sae(source["sae"]).encode(x)[:, list(spec.features)]


def read_scale(spec: MonitorSpec, source: dict, stream: torch.Tensor) -> torch.Tensor:
    """``[tokens]``: the size of what the monitor reads before its activation (an SAE's
    pre-activations of its features, a linear direction's ``||w|| ||x|| + |b|``, a
    probe's probability, times its logits' size where they are above 1). A ReLU that
    zeroes most of a token's features, or a linear score crossing zero, leaves a tiny
    score whose relative error would measure the stream's float32 rounding, not the
    monitor. So does a saturated probe: ``dp / p = (1 - p) dz``, its probability's
    relative error is its logit's absolute error, which grows with the logit (a logit
    of -18.9 off by 6e-6 of itself moves ``p = 6e-9`` by 1.2e-4 of itself)."""
    from trainers.checkpoint import load_probe, load_sae

    with torch.no_grad():
        if spec.kind == "probe":  # a probability: never near a sign change
            z = load_probe(source["probe"])(stream.float())
            p = torch.sigmoid(z)
            return p.norm(dim=-1) * z.norm(dim=-1).clamp_min(1.0)
        if spec.kind == "weight":  # a dot product's own scale: ||w|| ||x|| + |b|
            w = torch.tensor(source["weight"], dtype=torch.float32)
            return w.norm() * stream.float().norm(dim=-1) + abs(source["bias"])
        sae = load_sae(source["sae"])
        pre = sae.pre_acts(stream.float() * sae.norm_scale)[:, list(spec.features)]
        return pre.norm(dim=-1)


def stream_bound(spec: MonitorSpec, source: dict, stream: torch.Tensor) -> torch.Tensor:
    """``[tokens]``: ``B`` with ``||score(x + d) - score(x)|| <= B * ||d|| / ||x||``.

    A bf16 engine and HF in bf16 compute streams that differ by rounding (the capture
    oracle bounds it: ``||d|| <= 2% ||x||``); this is how far that can move a score,
    by the monitor's own Lipschitz constant: a probe's standardised weights (times
    the sigmoid's largest slope, 1/4), a direction's norm, an SAE's chosen encoder
    columns (ReLU and JumpReLU away from its thresholds move no more than their
    pre-activations). An error within ``tol * B`` is the stream's, not the monitor's."""
    from trainers.checkpoint import load_probe, load_sae

    x = stream.float().norm(dim=-1)
    with torch.no_grad():
        if spec.kind == "probe":
            p = load_probe(source["probe"])
            return 0.25 * (p.linear.weight * p.inv_std).norm() * x
        if spec.kind == "weight":
            return torch.tensor(source["weight"], dtype=torch.float32).norm() * x
        sae = load_sae(source["sae"])
        cols = sae.W_enc.float()[:, list(spec.features)]
        return float(sae.norm_scale) * cols.norm() * x


def active_features(spec: MonitorSpec, source: dict, stream: torch.Tensor) -> torch.Tensor:
    """``[tokens, features]``: which of a JumpReLU or TopK monitor's features fire on
    ``stream`` (all True for monitors without a jump). Where two streams that differ
    by rounding (bf16 engine and HF) fire different features, the scores rightly
    differ by a feature's whole value: such tokens are counted, not compared."""
    from trainers.checkpoint import load_sae

    f = list(spec.features)
    if spec.kind not in ("jumprelu", "topk"):
        return torch.ones(len(stream), max(1, len(f)), dtype=torch.bool)
    with torch.no_grad():
        sae = load_sae(source["sae"])
        pre = sae.pre_acts(stream.float() * sae.norm_scale)
        if spec.kind == "jumprelu":
            return pre[:, f] > sae.log_threshold.exp()[f]
        top = torch.relu(pre).topk(int(sae.cfg.k), dim=-1).indices
        return (top[:, :, None] == torch.tensor(f)).any(dim=1)


class ScoreLog:
    """Keeps every score a reader receives, by (request, sample, monitor, layer)."""

    def __init__(self, address: str, **kw) -> None:
        self.reader = ScoreReader(address, window=1024, **kw)
        self.rows: dict[tuple, list] = defaultdict(list)  # -> [(pos, token, values, version)]
        self.meta: dict[tuple, tuple] = {}  # -> (hook, labels)
        self.ended: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                out = self.reader.recv(timeout=0.2)
                if not isinstance(out, ScoreStep):
                    continue
                with self._lock:
                    for e in out.ended:
                        self.ended.add((e.request_id, e.sample_index))
                    for s in out.scores:
                        key = (s.request_id, s.sample_index, s.monitor, s.layer)
                        self.meta[key] = (s.hook, s.labels)
                        for j, p in enumerate(s.positions.tolist()):
                            self.rows[key].append((p, int(s.token_ids[j]), s.values[j], s.version))
        except BaseException as e:
            self.error = e

    def wait_ended(self, keys, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error:
                raise self.error
            with self._lock:
                if all(k in self.ended for k in keys):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"request ends did not arrive within {timeout}s")

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=10)
        self.reader.close()
        if self.error:
            raise self.error


def raw_monitor(model_path: Path, seed: int, layers: list[int], **kw) -> dict:
    """A ``weight`` monitor (a random direction of the model's width) for engines that
    need a monitor without checkpoints; ``kw``: ``bias``, ``sigmoid``, ``hook``."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    hidden = cfg.get("text_config", cfg)["hidden_size"]  # a multimodal wrapper's text model's
    w = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return {"weight": (w / w.norm()).tolist(), "layers": layers, **kw}


def raw_expected(monitor: dict, stream: torch.Tensor) -> torch.Tensor:
    """What a ``weight`` monitor reads on HF's ``stream`` ``[tokens, hidden]``: ``[tokens, 1]``."""
    w = torch.tensor(monitor["weight"], dtype=torch.float64)
    pre = stream.double() @ w + float(monitor.get("bias", 0.0))
    return (torch.sigmoid(pre) if monitor.get("sigmoid") else pre)[:, None]


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the scores' own scale (one number per comparison)."""
    scale = float(ref.abs().max()) or 1.0
    return float((got.double() - ref.double()).abs().max()) / scale


def as_f32(values: list) -> np.ndarray:
    """JSON values (nested lists, null for non-finite) as float32."""
    return np.array(values, dtype=np.float64).astype(np.float32)
