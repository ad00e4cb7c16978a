"""Monitor sources for the shared Llama engine, made with the trainers' own code.

A probe (trained a few steps on the tiny model's own stream) and three SAEs (ReLU,
JumpReLU, TopK) are written with ``save_probe``/``save_sae`` before the engine starts,
and the engine's ``actbus.monitor`` entry points at them. The oracle is the trainers'
own modules loaded back (``load_probe``, ``load_sae``) applied to HF transformers'
hidden states, so the engine's folding of the checkpoints is checked, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

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


def _stream(model_path: Path, layer: int, hook: str) -> torch.Tensor:
    from tests.support.oracle import hf_activations

    gen = torch.Generator().manual_seed(layer)
    ids = torch.randint(3, 400, (160,), generator=gen).tolist()
    return hf_activations(model_path, ids, [layer], [hook])[(layer, hook)]


def build_monitor_sources(model_path: Path, out: Path, hidden: int) -> dict:
    """Write the checkpoints under ``out``; returns the engine's ``actbus.monitor`` entry."""
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
    probe's probability). A ReLU that zeroes most of a token's features, or a linear
    score crossing zero, leaves a tiny score whose relative error would measure the
    stream's float32 rounding, not the monitor."""
    from trainers.checkpoint import load_sae

    with torch.no_grad():
        if spec.kind == "probe":  # a probability: never near a sign change
            return expected_scores(spec, source, stream).norm(dim=-1)
        if spec.kind == "weight":  # a dot product's own scale: ||w|| ||x|| + |b|
            w = torch.tensor(source["weight"], dtype=torch.float32)
            return w.norm() * stream.float().norm(dim=-1) + abs(source["bias"])
        sae = load_sae(source["sae"])
        pre = sae.pre_acts(stream.float() * sae.norm_scale)[:, list(spec.features)]
        return pre.norm(dim=-1)
