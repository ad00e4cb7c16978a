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
