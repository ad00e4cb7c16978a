"""HF transformers' own forward pass on the same weights: the capture oracle."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Where each hook point is in HF's decoder layers: (module, "in" | "out").
# ``pre_attn``/``post_block`` are the layer's own input/output.
HF_POINTS = {
    "llama": {"post_attn": ("post_attention_layernorm", "in"), "mlp_out": ("mlp", "out")},
    "gemma": {
        "post_attn": ("pre_feedforward_layernorm", "in"),
        "mlp_out": ("post_feedforward_layernorm", "out"),
    },
    # OLMo 2 normalises after attention and after the MLP: the MLP reads the stream.
    "olmo2": {"post_attn": ("mlp", "in"), "mlp_out": ("post_feedforward_layernorm", "out")},
}


@functools.lru_cache(maxsize=2)
def hf_model(
    path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", experts: str = "eager"
):
    """HF's model of ``path``, attending as vLLM does: causally over text, its MoE experts
    computed by HF's reference loop (``experts``: HF's ``experts_implementation``; its
    default, ``grouped_mm``, takes another kernel on CUDA than on CPU).

    PaliGemma's config marks its text model's attention non-causal
    (``use_bidirectional_attention``, set by ``PaliGemmaConfig`` when a checkpoint leaves
    it unset): a prefix-LM over image and prompt when ``token_type_ids`` says where the
    prefix ends. Without them HF builds a causal mask, but SDPA drops a mask it can
    express as ``is_causal`` and then reads the module's flag: HF's text-only forward
    attends bidirectionally on every layer whose mask was dropped (all of them on short
    prompts, the full-attention ones past the sliding window) and causally elsewhere;
    eager attention is causal throughout. vLLM's Gemma 2 is causal over text (its
    multimodal prefix covers image tokens only), so the oracle computes HF's causal
    forward, the one eager attention gives, on every attention backend.
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    if getattr(text, "use_bidirectional_attention", None) is True:
        text.use_bidirectional_attention = False
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    except ValueError:  # a multimodal wrapper that no causal-LM class maps (PaliGemma)
        m = transformers.AutoModelForImageTextToText.from_pretrained(
            path, config=config, dtype=dtype
        )
    if experts and getattr(m, "_can_set_experts_implementation", lambda: False)():
        m.set_experts_implementation(experts)
    return m.to(device).eval()


def hf_family(model) -> str:
    """Which ``HF_POINTS`` entry names the points of ``model``'s layers."""
    name = type(model).__name__
    return "olmo2" if "Olmo2" in name else "gemma" if "Gemma" in name else "llama"


def hf_layers(model):
    """HF's decoder layers, the language model's in a multimodal wrapper (Idefics3 names
    it ``text_model``)."""
    inner = model.model
    for name in ("language_model", "text_model"):
        inner = getattr(inner, name, inner)
    return inner.layers


def hf_mlp_scale(model) -> float:
    """What the MLP's output is multiplied by before it joins the stream (Granite's
    ``residual_multiplier``; 1 elsewhere): ``mlp_out`` is what the stream gains."""
    return float(getattr(model.config, "residual_multiplier", 1.0))


def _first(x):
    return (x[0] if isinstance(x, tuple) else x)[0].detach().clone()


def hf_activations(
    path: Path,
    token_ids: list[int],
    layers: list[int],
    hooks: list[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    experts: str = "eager",
) -> dict[tuple[int, str], torch.Tensor]:
    """``[len(token_ids), hidden]`` per (layer, hook), read with module hooks.

    ``post_block`` of the last layer is pre-final-norm (a forward hook on the layer,
    not ``hidden_states[-1]``). Cross-checks: ``post_block`` equals
    ``hidden_states[layer + 1]`` below the last layer, ``pre_attn`` equals
    ``hidden_states[layer]``, and ``post_block == post_attn + mlp_out``.
    """
    model = hf_model(str(path), dtype, device, experts)
    family, scale = hf_family(model), hf_mlp_scale(model)
    outs: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def save(key):
        return lambda _m, args, out=None: outs.__setitem__(
            key, _first(out if out is not None else args)
        )

    for layer in layers:
        mod = hf_layers(model)[layer]
        handles.append(
            mod.register_forward_pre_hook(
                lambda _m, args, kwargs, key=(layer, "pre_attn"): outs.__setitem__(
                    key, _first(args[0] if args else kwargs["hidden_states"])
                ),
                with_kwargs=True,
            )
        )
        handles.append(
            mod.register_forward_hook(
                lambda _m, _i, out, key=(layer, "post_block"): outs.__setitem__(key, _first(out))
            )
        )
        for hook, (name, where) in HF_POINTS[family].items():
            sub = getattr(mod, name)
            if where == "in":
                handles.append(
                    sub.register_forward_pre_hook(
                        lambda _m, args, key=(layer, hook): outs.__setitem__(key, _first(args[0]))
                    )
                )
            else:
                handles.append(
                    sub.register_forward_hook(
                        lambda _m, _i, out, key=(layer, hook): outs.__setitem__(
                            key, _first(out) * scale if key[1] == "mlp_out" else _first(out)
                        )
                    )
                )
    try:
        with torch.no_grad():
            res = model(torch.tensor([token_ids], device=device), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    n_layers = len(hf_layers(model))
    for layer in layers if dtype == torch.float32 else ():
        torch.testing.assert_close(outs[(layer, "pre_attn")], res.hidden_states[layer][0])
        if layer < n_layers - 1:
            torch.testing.assert_close(outs[(layer, "post_block")], res.hidden_states[layer + 1][0])
        torch.testing.assert_close(
            outs[(layer, "post_block")], outs[(layer, "post_attn")] + outs[(layer, "mlp_out")]
        )
    return {k: v for k, v in outs.items() if k[1] in hooks}


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row, ``||got - ref|| / ||ref||``: each token's relative error."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-12)


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max over rows of ``rel_errors``."""
    return float(rel_errors(got, ref).max())
