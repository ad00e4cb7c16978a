"""SAE kinds and checkpoints: every kind learns, keeps unit decoder rows, and reloads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support.trainer_synth import planted, sample
from trainers.checkpoint import load_sae, save_sae
from trainers.config import SAEConfig
from trainers.sae import SparseAutoencoder, geometric_median

KINDS = ("topk", "batchtopk", "relu", "jumprelu")


def _train(
    cfg: SAEConfig, steps: int, autocast: bool = False
) -> tuple[SparseAutoencoder, list[float]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    atoms, _ = planted()
    g = torch.Generator().manual_seed(7)
    sae = SparseAutoencoder(cfg)
    opt = torch.optim.Adam(sae.parameters(), lr=cfg.lr)
    fvus = []
    l0s = []
    for _ in range(steps):
        x = 3.0 * sample(256, g, atoms) + 0.5  # off-centre and off-scale: normalisation matters
        if not bool(sae.initialized):
            sae.initialize(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = sae.training_loss(x)
        opt.zero_grad()
        out["loss"].backward()
        sae.remove_parallel_grad()
        opt.step()
        sae.normalize_decoder()
        fvus.append(float(out["fvu"].detach()))
        l0s.append(float(out["l0"].detach()))
    sae.l0_history = l0s
    return sae, fvus


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_learns_and_reloads(kind, tmp_path):
    cfg = SAEConfig(d_in=64, d_sae=256, kind=kind, k=8, lr=3e-3, dead_tokens=2048)
    sae, fvus = _train(cfg, 100)
    print(kind, fvus[:3], fvus[-3:])
    assert sum(fvus[-10:]) / 10 < 0.8 * sum(fvus[:3]) / 3, (fvus[:3], fvus[-10:])
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(256), atol=1e-5)
    # Sparse, not just small: relu/jumprelu's penalties bring L0 well below d_sae.
    assert sae.l0_history[-1] <= (8 if kind == "topk" else 8 * 1.5 if kind == "batchtopk" else 64)
    # The scale makes the mean squared norm of the scaled inputs d_in.
    x = 3.0 * sample(4096, torch.Generator().manual_seed(9), planted()[0]) + 0.5
    assert float((x * sae.norm_scale).pow(2).sum(-1).mean()) == pytest.approx(64, rel=0.05)

    path = save_sae(sae, tmp_path / "sae", model="synthetic")
    cfg_json = json.loads((path / "cfg.json").read_text())
    weights = load_file(str(path / "sae_weights.safetensors"))
    assert weights["W_enc"].shape == (64, 256) and weights["W_dec"].shape == (256, 64)
    assert weights["b_enc"].shape == (256,) and weights["b_dec"].shape == (64,)
    assert cfg_json["d_in"] == 64 and cfg_json["d_sae"] == 256
    meta = cfg_json["metadata"]
    assert meta["actbus"]["kind"] == kind and meta["actbus"]["layer"] == 0
    assert meta["actbus"]["norm_scale"] == float(sae.norm_scale)
    assert meta["model_name"] == "synthetic" and meta["hook_name"] == "blocks.0.hook_resid_post"
    assert cfg_json["normalize_activations"] == "none"  # the scale is in the weights
    s = float(sae.norm_scale)
    torch.testing.assert_close(weights["W_enc"], sae.W_enc.detach() * s)
    torch.testing.assert_close(weights["b_dec"], sae.b_dec.detach() / s)
    if kind == "topk":
        assert cfg_json["architecture"] == "topk" and cfg_json["k"] == 8
    if kind in ("jumprelu", "batchtopk"):  # batchtopk: as SAELens stores it for inference
        assert cfg_json["architecture"] == "jumprelu"
        assert weights["threshold"].shape == (256,)

    fresh = load_sae(path)
    assert fresh is not sae
    sae.eval()
    fresh.eval()
    with torch.no_grad():
        a, b = sae(x), fresh(x)
        za, zb = sae.encode(x), fresh.encode(x)
    # The weights are unfolded from the saved ones: one rounding each, no more.
    assert torch.equal(za > 0, zb > 0)
    torch.testing.assert_close(zb, za, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert (za > 0).any()
    # And it reconstructs in the stream's own units.
    fvu = float((a - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert fvu < 0.7, fvu


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast_trains_as_well_as_fp32(kind):
    """Under bf16 autocast (the trainers' GPU default) the encoder's output, bias
    included, is bf16 and b_dec's gradient comes from _CentredBias in bf16. Training
    must land where fp32 training does."""
    cfg = SAEConfig(d_in=64, d_sae=256, kind=kind, k=8, lr=3e-3, dead_tokens=2048)
    _, fp32 = _train(cfg, 100)
    sae, bf16 = _train(cfg, 100, autocast=True)
    first, last = sum(bf16[:3]) / 3, sum(bf16[-10:]) / 10
    ref = sum(fp32[-10:]) / 10
    print(kind, "fp32", ref, "bf16", first, last)
    assert last < 0.8 * first, (bf16[:3], bf16[-10:])
    assert abs(last - ref) <= 0.05 * ref + 0.01, (ref, last)
    assert sae.W_enc.dtype == sae.W_dec.dtype == sae.b_dec.dtype == torch.float32
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(256), atol=1e-5)


def test_sparse_and_dense_decoders_agree():
    x = torch.randn(64, 32)
    grads = []
    for decoder in ("sparse", "dense"):
        cfg = SAEConfig(d_in=32, d_sae=128, kind="topk", k=4, decoder=decoder, aux_k=8)
        sae = SparseAutoencoder(cfg)
        sae.since_fired.fill_(10**9)  # all dead: AuxK runs too
        out = sae.training_loss(x)
        out["loss"].backward()
        grads.append([p.grad.clone() for p in sae.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_encoder_gives_b_dec_the_gradient_of_plain_centring(autocast):
    """pre_acts routes b_dec's gradient through a matrix-vector product instead of a
    per-row gradient; values and every gradient must match (x - b_dec) @ W_enc + b_enc
    (under autocast, where pre_acts computes in bf16: that expression on the same
    bf16-rounded operands, to bf16's precision)."""
    g = torch.Generator().manual_seed(5)
    sae = SparseAutoencoder(SAEConfig(d_in=32, d_sae=128, kind="topk", k=4))
    with torch.no_grad():
        sae.b_dec.copy_(torch.randn(32, generator=g))
        sae.b_enc.copy_(torch.randn(128, generator=g))
    xn, up = torch.randn(64, 32, generator=g), torch.randn(64, 128, generator=g)
    grads, values = [], []
    dt = torch.bfloat16 if autocast else torch.float32
    for plain in (False, True):
        sae.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if plain:  # in fp32 on the bf16-rounded operands: autograd's sums exact
                w, b_enc, b_dec = (t.to(dt).float() for t in (sae.W_enc, sae.b_enc, sae.b_dec))
                with torch.autocast("cpu", enabled=False):
                    pre = ((xn.to(dt).float() - b_dec) @ w + b_enc).to(dt)
            else:
                pre = sae.pre_acts(xn)
        assert pre.dtype == dt
        (pre.float() * up).sum().backward()
        values.append(pre.detach().float())
        grads.append([sae.b_dec.grad.clone(), sae.W_enc.grad.clone(), sae.b_enc.grad.clone()])
    if autocast:  # bf16 rounds each element by up to 2**-8 of the tensor's scale
        for a, b in zip([values[0], *grads[0]], [values[1], *grads[1]], strict=True):
            assert float((a - b).abs().max()) <= 2e-2 * float(b.abs().max()), (a, b)
    else:
        assert torch.equal(values[0], values[1])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert grads[0][0].abs().sum() > 0


def test_geometric_median_resists_outliers():
    x = torch.zeros(101, 4)
    x[:3] = 1000.0
    assert geometric_median(x).abs().max() < 1.0
    assert x.mean(0).abs().max() > 25


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="kind"):
        SAEConfig(d_in=8, kind="gated")
    with pytest.raises(ValueError, match=r"k: expected 1\.\.d_sae"):
        SAEConfig(d_in=8, expansion=2, k=17)
    with pytest.raises(ValueError, match="b_dec_init"):
        SAEConfig(d_in=8, b_dec_init="median")
    with pytest.raises(ValueError, match=r"^/nonexistent/dir: .* has no cfg\.json; is it an SAE"):
        load_sae("/nonexistent/dir")  # read through actbus.checkpoints, the one reader


def test_default_names_use_the_stream_name_and_old_named_checkpoints_still_load(tmp_path):
    """Trainer outputs are named by the stream (``L3.post_block-...``); a checkpoint
    directory an older actbus named ``L3-post_block-...`` loads as before, in the
    trainers and as an engine's vector source."""
    from actbus.steer.config import VectorSource
    from actbus.steer.vectors import load_source
    from trainers.config import ProbeConfig

    assert SAEConfig(d_in=16, layer=3, k=8, expansion=4).name == "L3.post_block-topk-k8-x4"
    # issue 50: k means nothing to relu and jumprelu; their names do not carry it
    for kind in ("relu", "jumprelu"):
        name = SAEConfig(d_in=16, layer=3, k=8, expansion=4, kind=kind).name
        assert name == f"L3.post_block-{kind}-x4"
    assert SAEConfig(d_in=16, k=8, kind="batchtopk").name == "L0.post_block-batchtopk-k8-x16"
    assert ProbeConfig(d_in=16, layer=3).name == "L3.post_block-probe-logistic"
    old = "L3-post_block-topk-k8-x4"
    sae, _ = _train(SAEConfig(d_in=64, d_sae=256, k=8, layer=3, name=old), 5)
    path = save_sae(sae, tmp_path / old, model="synthetic")
    fresh = load_sae(tmp_path / old)
    assert path == tmp_path / old and fresh.cfg.name == old and fresh.cfg.layer == 3
    row = load_source(VectorSource("sae", str(tmp_path / old), feature=7), "steer.vectors.f7")
    w = sae.W_dec.detach()[7]
    torch.testing.assert_close(torch.from_numpy(row), w / w.norm(), rtol=1e-5, atol=1e-6)


def test_load_sae_and_load_probe_read_files_through_the_one_reader(tmp_path):
    """``load_sae``/``load_probe`` read through ``actbus.checkpoints`` (bounded config,
    tensors bounded from their headers): a hostile or mismatched file is a ValueError
    naming the file (these were an AttributeError, a TypeError, a RuntimeError of
    ``copy_`` and a 2 MiB config read whole)."""
    from safetensors.torch import save_file

    from trainers.checkpoint import load_probe, save_probe
    from trainers.config import ProbeConfig
    from trainers.linear_probe import LinearProbe

    sae = SparseAutoencoder(SAEConfig(d_in=8, d_sae=16, k=4))
    sae.initialize(torch.randn(32, 8))
    path = save_sae(sae, tmp_path / "sae")
    cfg = json.loads((path / "cfg.json").read_text())
    (path / "cfg.json").write_text(json.dumps({**cfg, "metadata": [1]}))
    with pytest.raises(ValueError, match=r"cfg\.json: no actbus metadata"):
        load_sae(path)
    (path / "cfg.json").write_text(json.dumps({**cfg, "pad": "x" * (2 << 20)}))
    with pytest.raises(ValueError, match=r"cfg\.json is over 1 MiB; not an SAE's config"):
        load_sae(path)
    (path / "cfg.json").write_text(json.dumps(cfg))
    w = load_file(str(path / "sae_weights.safetensors"))
    save_file({**w, "W_enc": torch.zeros(9, 16)}, str(path / "sae_weights.safetensors"))
    with pytest.raises(ValueError, match=r"W_enc is \[9, 16\], its config's SAE has \[8, 16\]"):
        load_sae(path)

    probe = save_probe(LinearProbe(ProbeConfig(d_in=8)), tmp_path / "probe")
    (probe / "probe.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"probe\.json is not a probe's config$"):
        load_probe(probe)
