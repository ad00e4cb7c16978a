"""What is known of model families without torch, for ``actbus serve``'s check from the
model's config.json before vLLM starts (``actbus.precheck``) and the engine's before
weights load.

Capture does not keep a list of the architectures it allows: the engine reads each
model's decoder layers by structure once they load (``actbus.engine.anatomy``) and
refuses, naming what it found, a layer of no form it reads. ``REFUSED`` holds that
verdict for the families known to fit no form (each entry is checked against vLLM's
source by ``tests/capture/test_anatomy.py``), so that ``actbus serve`` says it in a
second instead of after an engine start; an architecture not named here is left to the
engine's structural check.
"""

from __future__ import annotations

from actbus.errors import ConfigError

REFUSED: dict[str, str] = {
    "CohereForCausalLM": (
        "its layer (vLLM's CohereDecoderLayer) takes a residual but never reads it: the "
        "residual stream entering a layer is not its input"
    ),
    "MiniCPMForCausalLM": (
        "its layer (vLLM's MiniCPMDecoderLayer) returns (hidden_states, None): the stream "
        "after attention is never handed on"
    ),
}
"""Architecture -> why no form actbus reads fits its decoder layers."""

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


def check_architecture(architectures: list[str] | None) -> None:
    """Refuse, naming it and why, an architecture known to fit no form."""
    for a in architectures or []:
        if a in REFUSED:
            raise ConfigError(
                f"actbus: architecture {a} is not supported for capture: {REFUSED[a]} "
                "(docs/families.md)"
            )
