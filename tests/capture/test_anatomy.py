"""The layer anatomy read from vLLM's own sources, without an engine: every family
``actbus.engine.archs.REFUSED`` names really fits no form, and the families the suite
serves are read in the form the taps expect."""

from __future__ import annotations

import importlib

import pytest

from actbus.engine.anatomy import RESIDUAL, layer_form
from actbus.engine.archs import REFUSED
from actbus.errors import ConfigError

LAYER_CLASSES = {
    "CohereForCausalLM": ("vllm.model_executor.models.commandr", "CohereDecoderLayer"),
    "MiniCPMForCausalLM": ("vllm.model_executor.models.minicpm", "MiniCPMDecoderLayer"),
}


def _cls(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_every_refused_family_fits_no_form(arch):
    assert arch in LAYER_CLASSES, f"{arch}: name its vLLM layer class here"
    with pytest.raises(ConfigError, match="fits no form actbus reads: found"):
        layer_form(_cls(*LAYER_CLASSES[arch]))


@pytest.mark.parametrize(
    "module, name",
    [
        ("vllm.model_executor.models.llama", "LlamaDecoderLayer"),
        ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer"),
        ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeDecoderLayer"),
        ("vllm.model_executor.models.mixtral", "MixtralDecoderLayer"),
    ],
)
def test_served_families_read_in_the_residual_form(module, name):
    form = layer_form(_cls(module, name))
    assert form.name == RESIDUAL.name and form.adapter is None
    assert form.post_attn_norm == "post_attention_layernorm"
    assert not form.stream_first


@pytest.mark.parametrize(
    "module, name",
    [
        ("vllm.model_executor.models.gpt_oss", "TransformerBlock"),
        ("vllm.model_executor.models.bailing_moe_v3", "BailingMoeV3DecoderLayer"),
    ],
)
def test_stream_first_layers_read_in_the_residual_form(module, name):
    """gpt-oss's layer is called ``(hidden_states, positions, residual)`` and returns
    ``output, residual``: the residual form, its first two arguments swapped."""
    form = layer_form(_cls(module, name))
    assert form.name == RESIDUAL.name and form.adapter is None and form.stream_first
    assert form.post_attn_norm == "post_attention_layernorm"
