"""HF transformers' routing on the same weights: the ``router`` hook's oracle.

Each MoE layer's router logits are read at its router linear; the top-k
choice is made from them here as each family's HF code makes it, so the engine's ids
and weights are checked against the family's own semantics, not against actbus's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.oracle import hf_model


def _grouped(scores: torch.Tensor, groups: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V2's group-limited greedy: experts outside the best groups masked."""
    n, e = scores.shape
    best = scores.view(n, groups, -1).max(dim=-1).values
    keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, dim=-1).indices, 1.0)
    mask = keep.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
    return scores.masked_fill(mask == 0, 0.0)


def _router_modules(model) -> dict[int, torch.nn.Module]:
    """Each MoE layer's router linear (``gate`` or ``router``: weight ``[experts, hidden]``),
    by layer index. Read from the modules, not from ``output_router_logits``, which not
    every transformers release returns for every family (DeepSeek-V2 in 5.17)."""
    from tests.support.oracle import hf_layers

    experts = _num_experts(model.config)
    found = {}
    for i, layer in enumerate(hf_layers(model)):
        for name, mod in layer.named_modules():
            w = getattr(mod, "weight", None)
            if (
                name.rsplit(".", 1)[-1] in ("gate", "router")
                and isinstance(w, torch.Tensor)
                and w.dim() == 2
                and w.shape[0] == experts
            ):
                found[i] = mod
                break
    return found


def _num_experts(c) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(c, key, None):
            return int(getattr(c, key))
    raise ValueError(f"{c.model_type}: no expert count in its config")


def hf_routing(
    path: Path,
    token_ids: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer (by its index in the model): ``(ids [n, k] int64, weights [n, k]
    float32)`` on the CPU, ids ascending per row (the order within a top-k is no part of
    the routing)."""
    model = hf_model(str(path), dtype, device)
    c = model.config.get_text_config()
    routers = _router_modules(model)
    logits_of: dict[int, torch.Tensor] = {}
    handles = [
        mod.register_forward_pre_hook(
            lambda m, args, i=i: logits_of.__setitem__(
                i, torch.nn.functional.linear(args[0], m.weight, getattr(m, "bias", None))
            )
        )
        for i, mod in routers.items()
    ]
    with torch.no_grad():
        model(torch.tensor([token_ids], device=device))
    for h in handles:
        h.remove()
    # DeepSeek's first layers are dense: no router there.
    first = getattr(c, "first_k_dense_replace", 0) or 0
    assert sorted(logits_of) == list(range(first, c.num_hidden_layers)), sorted(logits_of)
    k = c.num_experts_per_tok
    res = {}
    for layer in sorted(logits_of):
        logits = logits_of[layer].reshape(len(token_ids), -1).float().cpu()
        if c.model_type == "gpt_oss":  # top-k of the logits, then softmax over them
            vals, ids = logits.topk(k, dim=-1)
            weights = vals.softmax(dim=-1)
        else:
            probs = logits.softmax(dim=-1)
            if c.model_type == "deepseek_v2":
                probs = _grouped(probs, c.n_group, c.topk_group)
            weights, ids = probs.topk(k, dim=-1)
            if c.model_type == "mixtral" or getattr(c, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            elif c.model_type == "deepseek_v2":
                weights = weights * c.routed_scaling_factor
        order = ids.argsort(dim=-1)
        res[layer] = (ids.gather(1, order), weights.gather(1, order))
    return res


def split_sorted(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A router stream's ``[n, 2k]`` rows as ``(ids, weights)``, ids ascending per row."""
    k = rows.shape[1] // 2
    ids, weights = rows[:, :k].round().long(), rows[:, k:].float()
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)
