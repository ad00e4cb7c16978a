"""The architectures capture supports, and the check, with no torch: ``actbus serve``
refuses another one from the model's config.json before vLLM starts
(``actbus.precheck``), the engine again from vLLM's config."""

from __future__ import annotations

from actbus.errors import ConfigError

# Architectures whose vLLM decoder layers take ``(positions, hidden_states,
# residual)`` and return ``(hidden_states, residual)`` where, on the way out,
# ``residual`` is the stream after attention was added and ``hidden_states`` is what
# the MLP block adds (Gemma: after its post-feedforward norm). On the way in the
# stream is ``hidden_states + residual`` (the first layer gets ``residual=None``
# and the embeddings). Every hook point is read off the layer's own inputs and
# outputs, so no attention or MLP module is touched.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    # Mixture-of-experts (``mlp_out`` is the whole MoE block's output, shared experts
    # included; the ``router`` hook reads their routers: ``actbus.engine.moe``).
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
)

_TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token")
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_router(config: dict, hooks: tuple[str, ...], architecture: str) -> None:
    """Refuse the ``router`` hook on a model whose config names no experts (dense);
    ``config`` is the model's config.json (or vLLM's ``hf_config`` as a dict)."""
    if "router" not in hooks:
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    fields = {**text, **config}
    experts = next((fields[f] for f in _EXPERT_FIELDS if fields.get(f)), 0)
    top_k = next((fields[f] for f in _TOP_K_FIELDS if fields.get(f)), 0)
    if not experts or not top_k:
        raise ConfigError(
            f"actbus.hooks: 'router' is a hook of mixture-of-experts models only; "
            f"{architecture} has no experts (a dense model); drop 'router' from actbus.hooks"
        )


def check_architecture(architectures: list[str] | None) -> str:
    """The supported architecture of a model, or a ConfigError naming it."""
    archs = list(architectures or [])
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    raise ConfigError(
        f"actbus: architecture {archs or '(unknown)'} is not supported for capture; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
