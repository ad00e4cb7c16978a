"""SAEs that SAELens itself saved (``SAE.save_model``), read by actbus: a monitor's
scores equal SAELens' ``encode`` (``SAE.load_from_disk``) on the same rows, for the
standard, JumpReLU and TopK architectures and the options that change ``encode``
(``apply_b_dec_to_input``, ``rescale_acts_by_decoder_norm``, negative JumpReLU
thresholds, a bfloat16 file, a config in SAELens' layout before 6.0); SAELens'
``hook_name``s map to actbus's streams; and what actbus cannot read the way SAELens
does (another model's width, a stream actbus does not tap, an unfolded normalisation,
another architecture) is refused by name by the monitor's loader, by steering and by
``actbus serve``'s precheck. Real files, SAELens' own code; the engine's rows are
checked in tests/monitor/test_monitor_saelens.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from actbus.checkpoints import SAE_CFG, SAE_WEIGHTS, hook_point, read_sae_info
from actbus.config import CaptureConfig
from actbus.errors import ConfigError
from actbus.monitor.config import MonitorConfig
from actbus.monitor.graph import Segment, monitor_scores
from actbus.monitor.weights import load_weights
from actbus.precheck import foreign_sources, model_shape, precheck
from actbus.steer.config import VectorSource
from actbus.steer.vectors import load_source
from tests.support.monitors import save_saelens_sae

H = 32
FEATURES = list(range(0, 64, 3))


def _stream(n: int = 400, seed: int = 0) -> torch.Tensor:
    """Rows shaped like a residual stream: an offset, a few large directions."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(4, H, generator=g) * 3
    return 1.5 + torch.randn(n, 4, generator=g) @ basis + torch.randn(n, H, generator=g)


def _scores(path: Path, x: torch.Tensor, features=FEATURES, hidden: int = H) -> torch.Tensor:
    """What an engine's monitor of ``path``'s SAE publishes for rows ``x``."""
    raw = {"monitors": {"m": {"sae": str(path), "features": features, "layers": [1]}}}
    mw = load_weights(MonitorConfig.from_dict(raw).monitors["m"], hidden, "m")
    seg = Segment(0, mw.cols, mw.activation, mw.k)
    t = [torch.from_numpy(a) for a in (mw.weight, mw.bias, mw.theta)]
    return monitor_scores(x, *t, (seg,))[:, list(mw.published)]


def _encode(path: Path, x: torch.Tensor, features=FEATURES) -> tuple[torch.Tensor, torch.Tensor]:
    """SAELens' own ``encode`` of the directory, and each row's pre-activation scale."""
    from sae_lens import SAE

    sae = SAE.load_from_disk(path, dtype="float32")
    with torch.no_grad():
        z = sae.encode(x)[:, features]
        pre = sae.process_sae_in(x) @ sae.W_enc + sae.b_enc
    return z, pre.norm(dim=1)


CASES = {
    "standard": ("standard", {}),
    "standard-no-b_dec-on-input": ("standard", {"apply_b_dec_to_input": False}),
    "jumprelu": ("jumprelu", {}),
    "topk": ("topk", {}),
    "topk-rescaled-by-decoder-norm": ("topk", {"rescale_acts_by_decoder_norm": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_monitor_scores_what_saelens_encode_gives(tmp_path, case):
    arch, cfg = CASES[case]
    x = _stream()
    save_saelens_sae(tmp_path / "sae", arch, x[:200], "blocks.1.hook_resid_post", **cfg)
    got = _scores(tmp_path / "sae", x)
    ref, scale = _encode(tmp_path / "sae", x)
    assert (ref > 0).any() and (ref == 0).any(), "the latents never fired, or always"
    flip = (got > 0) != (ref > 0)
    assert int(flip.sum()) <= 1, f"{int(flip.sum())} latents fire on one side only"
    ok = ~flip.any(1)  # a flip sits on a gate, within rounding: that row is not compared
    err = (got - ref)[ok].norm(dim=1) / scale[ok]
    assert float(err.max()) <= 1e-6, float(err.max())


def test_negative_jumprelu_thresholds_gate_at_zero_as_saelens_does(tmp_path):
    """SAELens' JumpReLU is ``relu(pre) * (pre > threshold)``: where a threshold is
    negative, a pre-activation between it and 0 scores 0 (it used to score itself)."""
    x = _stream()
    sae = save_saelens_sae(tmp_path / "sae", "jumprelu", x, "blocks.1.hook_resid_post")
    assert bool((sae.threshold < 0).any())
    got, (ref, _) = _scores(tmp_path / "sae", x), _encode(tmp_path / "sae", x)
    assert bool((got >= 0).all()), float(got.min())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_file_and_a_config_from_before_saelens_6_read_alike(tmp_path):
    """A bfloat16 file is read as float32 (SAELens, asked for float32, reads the same
    numbers); a TopK SAE in SAELens' older layout (``hook_name`` at the top, TopK as
    ``activation_fn: topk``, no ``architecture``) reads as SAELens reads it, a TopK."""
    x = _stream()
    sae = save_saelens_sae(tmp_path / "bf16", "topk", x, "blocks.2.hook_resid_pre")
    w = load_file(str(tmp_path / "bf16" / SAE_WEIGHTS))
    save_file({k: v.bfloat16() for k, v in w.items()}, str(tmp_path / "bf16" / SAE_WEIGHTS))
    cfg = json.loads((tmp_path / "bf16" / SAE_CFG).read_text())
    (tmp_path / "bf16" / SAE_CFG).write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    torch.testing.assert_close(
        _scores(tmp_path / "bf16", x), _encode(tmp_path / "bf16", x)[0], rtol=1e-5, atol=1e-5
    )

    old = tmp_path / "old"
    old.mkdir()
    save_file({k: v.detach() for k, v in sae.state_dict().items()}, str(old / SAE_WEIGHTS))
    legacy = {
        "d_in": H,
        "d_sae": sae.cfg.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "model_name": "tiny-llama",
        "hook_name": "blocks.2.hook_resid_pre",
        "hook_layer": 2,
        "hook_head_index": None,
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 4},
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "sae_lens_training_version": "5.9.1",
    }
    (old / SAE_CFG).write_text(json.dumps(legacy))
    info = read_sae_info(old, "m.sae")
    assert (info.architecture, info.k, info.point) == ("topk", 4, (2, "pre_attn"))
    every = list(range(sae.cfg.d_sae))
    got, (ref, _) = _scores(old, x, every), _encode(old, x, every)
    assert int((ref > 0).sum(1).max()) == 4  # SAELens read it as TopK too
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "point"),
    [
        ("blocks.0.hook_resid_pre", (0, "pre_attn")),
        ("blocks.3.hook_resid_mid", (3, "post_attn")),
        ("blocks.12.hook_mlp_out", (12, "mlp_out")),
        ("blocks.3.hook_resid_post", (3, "post_block")),
        ("model.layers.3", (3, "post_block")),
        ("layers.7", (7, "post_block")),
        ("model.language_model.layers.5", (5, "post_block")),
    ],
)
def test_saelens_hook_names_map_to_actbus_streams(name, point):
    assert hook_point(name, "m") == point


@pytest.mark.parametrize(
    "name",
    [
        "blocks.3.hook_attn_out",
        "blocks.3.attn.hook_z",
        "blocks.3.ln2.hook_normalized",
        "blocks.3.mlp.hook_post",
        "model.layers.3.mlp",
        "model.layers.3.self_attn.o_proj",
        "hook_embed",
    ],
)
def test_a_stream_actbus_does_not_tap_is_refused_by_name(tmp_path, name):
    """At the monitor's load (the engine's start), at steering's, and at ``actbus
    serve``'s precheck: each names the field, the hook and what actbus taps."""
    save_saelens_sae(tmp_path / "sae", "standard", _stream(), name)
    msg = rf"hook_name '{name}' is not a stream actbus taps; it taps blocks\.L\.hook_resid_pre"
    with pytest.raises(ConfigError, match=rf"^m\.sae: {msg}"):
        _scores(tmp_path / "sae", _stream())
    with pytest.raises(ConfigError, match=rf"^v\.sae: {msg}"):
        load_source(VectorSource("sae", str(tmp_path / "sae"), feature=1), "v")
    with pytest.raises(ConfigError, match=rf"^actbus\.monitor\.monitors\.m\.sae: {msg}"):
        precheck(_serve_cfg(tmp_path / "sae"), _model(tmp_path))


def _model(tmp_path: Path, hidden: int = H):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    raw = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": hidden}
    raw["_name_or_path"] = "org/tiny-llama"  # what the SAEs' metadata.model_name names
    (d / "config.json").write_text(json.dumps(raw))
    return model_shape(str(d))


def _serve_cfg(path: Path, layers=(1,), hook="post_block") -> CaptureConfig:
    m = {"sae": str(path), "features": [1, 2], "layers": list(layers), "hook": hook}
    return CaptureConfig.from_dict({"layers": [1], "monitor": {"monitors": {"m": m}}})


def test_an_sae_of_another_width_is_refused_by_name(tmp_path):
    save_saelens_sae(tmp_path / "sae", "jumprelu", _stream(), "blocks.1.hook_resid_post")
    with pytest.raises(
        ConfigError,
        match=r"^m\.sae: the SAE reads 32-wide rows; this model's residual stream has 64: it "
        r"was made for another model \('tiny-llama', its cfg\.json\)$",
    ):
        _scores(tmp_path / "sae", torch.zeros(2, 64), hidden=64)
    with pytest.raises(
        ConfigError,
        match=r"^actbus\.monitor\.monitors\.m\.sae: the SAE reads 32-wide rows \(d_in, its "
        r"cfg\.json\); this model's residual stream has 64: it was made for another model",
    ):
        precheck(_serve_cfg(tmp_path / "sae"), _model(tmp_path, hidden=64))


def test_an_sae_at_another_stream_or_of_another_model_is_warned_about(tmp_path):
    """Taken (a user may mean it), but said, at the precheck and at engine start; the
    model is SAELens 6's ``metadata.model_name`` (it used to be read at the top only)."""
    save_saelens_sae(tmp_path / "sae", "standard", _stream(), "blocks.1.hook_resid_mid")
    assert precheck(_serve_cfg(tmp_path / "sae", hook="post_attn"), _model(tmp_path)) == []
    assert foreign_sources(_serve_cfg(tmp_path / "sae", hook="post_attn"), ["org/other"]) == [
        f"actbus.monitor.monitors.m: the sae at {tmp_path / 'sae'} was trained on 'tiny-llama' "
        "(its cfg.json), but the model served is 'org/other'; its directions may mean nothing "
        "in this model's stream"
    ]
    warned = foreign_sources(_serve_cfg(tmp_path / "sae", layers=(1, 2)), ["tiny-llama"])
    assert warned == [
        f"actbus.monitor.monitors.m: the sae at {tmp_path / 'sae'} was trained on layer 1's "
        "post_attn (hook_name 'blocks.1.hook_resid_mid', its cfg.json), but the monitor reads "
        "layer 1 post_block, layer 2 post_block"
    ]


def _edit(path: Path, **cfg) -> None:
    raw = json.loads((path / SAE_CFG).read_text())
    (path / SAE_CFG).write_text(json.dumps({**raw, **cfg}))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"normalize_activations": "expected_average_only_in"},
            r"normalize_activations is 'expected_average_only_in' \(its cfg\.json\); actbus "
            r"reads SAEs that take the raw stream \('none'\): fold the scale into the weights "
            r"first \(SAELens: sae\.fold_activation_norm_scaling_factor",
        ),
        (
            {"normalize_activations": "layer_norm"},
            r"normalize_activations is 'layer_norm' .* normalises each token by itself",
        ),
        ({"architecture": "gated"}, r"architecture 'gated' \(its cfg\.json\) is not one actbus"),
        ({"reshape_activations": "hook_z"}, r"reshape_activations 'hook_z' .* attention heads"),
        ({"metadata": {"hook_head_index": 2}}, r"hook_head_index in .* names one attention head"),
        ({"d_sae": 63}, r"cfg\.json says d_sae=63, but .* holds 64; the config and the weights"),
        ({"k": 65}, r"k in .* is 65; a TopK SAE keeps 1\.\.d_sae \(64\) latents"),
        ({"k": "4"}, r"k in .* is '4', not a positive integer"),
        ({"rescale_acts_by_decoder_norm": "yes"}, r"rescale_acts_by_decoder_norm in .* is not"),
    ],
)
def test_what_encode_would_read_otherwise_is_refused_by_field(tmp_path, edit, message):
    save_saelens_sae(tmp_path / "sae", "topk", _stream(), "blocks.1.hook_resid_post")
    _edit(tmp_path / "sae", **edit)
    with pytest.raises(ConfigError, match=rf"^m\.sae: {message}"):
        _scores(tmp_path / "sae", _stream())


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    save_saelens_sae(tmp_path / "sae", "jumprelu", _stream(), None)
    w = load_file(str(tmp_path / "sae" / SAE_WEIGHTS))
    w["threshold"][3] = float("nan")
    save_file(w, str(tmp_path / "sae" / SAE_WEIGHTS))
    with pytest.raises(ConfigError, match=r"^m\.sae: threshold in .* holds NaN or Inf values$"):
        _scores(tmp_path / "sae", _stream())


def test_a_named_vector_is_the_unit_decoder_row_saelens_saved(tmp_path):
    sae = save_saelens_sae(tmp_path / "sae", "topk", _stream(), "blocks.1.hook_resid_post")
    v = load_source(VectorSource("sae", str(tmp_path / "sae"), feature=9), "v")
    want = sae.W_dec[9].detach()
    np.testing.assert_allclose(v, (want / want.norm()).numpy(), rtol=1e-6, atol=1e-7)
