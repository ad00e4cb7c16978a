"""HF transformers' routing on the same weights: the ``router`` hook's oracle.

HF returns each MoE layer's router logits (``output_router_logits=True``); the top-k
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


def hf_routing(path: Path, token_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer (by its index in the model): ``(ids [n, k] int64, weights [n, k]
    float32)``, ids ascending per row (the order within a top-k is no part of the
    routing)."""
    model = hf_model(str(path))
    c = model.config
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    k = c.num_experts_per_tok
    # HF records only the MoE layers' logits: DeepSeek's first dense layers have none.
    first = getattr(c, "first_k_dense_replace", 0) or 0
    assert first + len(out.router_logits) == c.num_hidden_layers, "MoE layers not the last ones"
    res = {}
    for layer, logits in enumerate(out.router_logits, start=first):
        logits = logits.reshape(len(token_ids), -1).float()
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
