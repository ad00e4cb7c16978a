"""HF transformers with steering vectors added by module hooks: the steering oracle.

The same vector is added at the same point of the stream as actbus adds it in vLLM's
compiled graph: ``pre_attn`` to the layer's input, ``post_attn`` to the stream after
attention (in place, on the input of the norm before the MLP, so the residual HF keeps
is the same tensor and sees it too) and ``post_block`` to the layer's output. The
captured points read the steered stream, as actbus's taps do.

A gated entry (``HFGate``) multiplies its vector by the gate of a monitor's score,
computed here from the hooked stream at the monitor's point: the same token's (read
earlier in the same forward), or the token before's (this forward's when its point
runs earlier; else the previous greedy step's, and closed on prompt tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tests.support.oracle import (
    HF_POINTS,
    hf_family,
    hf_layers,
    hf_mlp_scale,
    hf_model,
    max_rel_error,
)

_STEER_RANK = {"pre_attn": 0, "post_attn": 2, "post_block": 5}
_MONITOR_RANK = {"pre_attn": 1, "post_attn": 3, "mlp_out": 4, "post_block": 6}


@dataclass
class HFGate:
    """A gate: ``score`` maps the stream ``[seq, hidden]`` at ``point`` to ``[seq]``."""

    point: tuple[int, str]
    score: Callable[[torch.Tensor], torch.Tensor]
    threshold: float
    sharpness: float | None = None
    source: str = "token"

    def values(self, at: tuple[int, str], acts, history, prompt_len: int, seq: int):
        """``[seq]``: the gate of each token for steering at ``at``."""
        m, s = self.point, at
        before = (m[0], _MONITOR_RANK[m[1]]) < (s[0], _STEER_RANK[s[1]])
        # Everything on the stream's device: the oracle runs on the engine's (CUDA on
        # the GPU checks), and a CPU tensor mixed in fails there only.
        dev = acts[m].device if m in acts else history.get(m, torch.zeros(0)).device
        pos = torch.arange(seq, device=dev)
        if self.source == "token":
            score = self.score(acts[m]).to(dev)
            closed = torch.zeros(seq, dtype=torch.bool, device=dev)
        elif before:
            score = torch.cat([torch.zeros(1, device=dev), self.score(acts[m]).to(dev)[:-1]])
            closed = pos == 0
        else:
            past = history.get(m, torch.zeros(0)).to(dev)
            score = torch.zeros(seq, device=dev)
            score[1 : min(seq, len(past) + 1)] = past[: seq - 1]
            closed = pos < prompt_len
        if self.sharpness is None:
            g = (score > self.threshold).float()
        else:
            g = torch.sigmoid(self.sharpness * (score - self.threshold))
        return torch.where(closed, 0.0, g)


@dataclass
class HFSteer:
    """One entry, as a request gives it, with its vector's values."""

    layer: int
    hook: str
    vector: torch.Tensor
    scale: float = 1.0
    norm_match: bool = False
    tier: str = "base"
    positions: object = "all"
    gate: HFGate | None = None

    def to(self, device) -> HFSteer:
        """This entry with its tensors on ``device`` (the engine's rows'), in place."""
        if self.vector is not None:
            self.vector = self.vector.to(device)
        for name in ("rows", "sae"):
            value = getattr(self, name, None)
            if value is not None:
                setattr(self, name, {k: v.to(device) for k, v in value.items()})
        return self

    def mask(self, n: int, prompt_len: int) -> torch.Tensor:
        pos = torch.arange(n)
        m = torch.ones(n, dtype=torch.bool)
        if self.tier == "prefill":
            m &= pos < prompt_len
        elif self.tier == "decode":
            m &= pos >= prompt_len
        p = self.positions
        if p == "prompt":
            m &= pos < prompt_len
        elif p == "generated":
            m &= pos >= prompt_len
        elif p == "last_prompt":
            m &= pos == prompt_len - 1
        elif not isinstance(p, str):
            m &= torch.isin(pos, torch.tensor(list(p)))
        return m

    def delta(self, stream: torch.Tensor, prompt_len: int, ctx=None) -> torch.Tensor:
        """``[seq, hidden]`` added to ``stream`` (``[seq, hidden]``); ``ctx``: (acts of
        this forward so far, the previous forward's gate scores) for a gated entry."""
        v = self.vector.to(stream.device, torch.float32)
        s = stream.float()
        if self.norm_match:
            coef = self.scale * s.norm(dim=-1, keepdim=True) / v.norm()
        else:
            coef = torch.full((s.shape[0], 1), self.scale, device=s.device)
        return (coef * self.weight(s, prompt_len, ctx) * v).to(stream.dtype)

    def weight(self, s: torch.Tensor, prompt_len: int, ctx) -> torch.Tensor:
        """``[seq, 1]``: 1 at the selected tokens, 0 elsewhere, times the gate if any
        (every operation's change is multiplied by it)."""
        mask = self.mask(s.shape[0], prompt_len)[:, None].to(s.device, torch.float32)
        if self.gate is not None:
            acts, history = ctx
            g = self.gate.values((self.layer, self.hook), acts, history, prompt_len, s.shape[0])
            mask = mask * g[:, None].to(s.device)
        return mask.to(s.dtype)


def _sum(steers, stream, prompt_len, ctx=None):
    out = torch.zeros_like(stream)
    for s in steers:
        out = out + s.delta(stream, prompt_len, ctx)
    return out


def hf_steered_forward(
    path,
    token_ids: list[int],
    prompt_len: int,
    steers: list[HFSteer],
    capture: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    history: dict | None = None,
) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor]]:
    """Logits ``[seq, vocab]`` and the captured points of ``capture`` layers (every hook).
    ``history``: the gates' scores of the previous forward, replaced by this one's."""
    model = hf_model(str(path), dtype, device)
    points, scale = HF_POINTS[hf_family(model)], hf_mlp_scale(model)
    acts: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    history = {} if history is None else history
    ctx = (acts, dict(history))
    at = {}
    for s in steers:
        at.setdefault((s.layer, s.hook), []).append(s)
    for i, layer in enumerate(hf_layers(model)):

        def pre(_m, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            x = x + _sum(at.get((i, "pre_attn"), []), x[0], prompt_len, ctx)[None]
            acts[(i, "pre_attn")] = x[0].clone()
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        def mid(_m, args, i=i):
            x = args[0]
            x.add_(_sum(at.get((i, "post_attn"), []), x[0], prompt_len, ctx)[None])  # in place
            acts[(i, "post_attn")] = x[0].clone()

        def post(_m, _args, out, i=i):
            h = out[0] if isinstance(out, tuple) else out
            h = h + _sum(at.get((i, "post_block"), []), h[0], prompt_len, ctx)[None]
            acts[(i, "post_block")] = h[0].clone()
            return (h, *out[1:]) if isinstance(out, tuple) else h

        def mlp(_m, _args, out, i=i):
            acts[(i, "mlp_out")] = (out[0] if isinstance(out, tuple) else out)[0].clone() * scale

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(getattr(layer, points["post_attn"][0]).register_forward_pre_hook(mid))
        handles.append(getattr(layer, points["mlp_out"][0]).register_forward_hook(mlp))
        handles.append(layer.register_forward_hook(post))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids], device=device)).logits[0]
    finally:
        for h in handles:
            h.remove()
    for s in steers:
        if s.gate is not None:
            history[s.gate.point] = s.gate.score(acts[s.gate.point].float())
    return logits, {k: v for k, v in acts.items() if k[0] in capture}


def hf_steered_greedy(
    path, prompt: list[int], max_tokens: int, steers: list[HFSteer], capture: list[int]
) -> tuple[list[int], dict[tuple[int, str], torch.Tensor]]:
    """Greedy tokens (the whole sequence recomputed per token: steering depends only on
    positions, so this equals incremental decoding) and the activations of every fed
    token (``prompt + output[:-1]``)."""
    ids, history = list(prompt), {}
    for _ in range(max_tokens):
        logits, _ = hf_steered_forward(path, ids, len(prompt), steers, [], history=history)
        ids.append(int(logits[-1].argmax()))
    _, acts = hf_steered_forward(path, ids[:-1], len(prompt), steers, capture, history=history)
    return ids[len(prompt) :], acts


@dataclass
class HFReplace(HFSteer):
    """``replace``: the stream at the selected tokens becomes ``vector`` (one row for
    all), or ``rows[p]`` at position ``p``."""

    rows: dict | None = None

    def delta(self, stream, prompt_len, ctx=None):
        s = stream.float()
        n = s.shape[0]
        mask = self.mask(n, prompt_len)
        want = s.clone()
        if self.rows is not None:
            for p, r in self.rows.items():
                if p < n and mask[p]:
                    want[p] = r.float()
        else:  # no boolean indexing: the meta-device dry run cannot take it
            want = torch.where(mask[:, None].to(s.device), self.vector.float(), s)
        return (self.weight(s, prompt_len, ctx) * (want - s)).to(stream.dtype)


@dataclass
class HFAblate(HFSteer):
    """``ablate``: the stream's component in the span of ``vector``'s rows ([m, hidden])
    taken out (the projection from the pseudo-inverse, not actbus's basis)."""

    def delta(self, stream, prompt_len, ctx=None):
        s = stream.double()
        d = self.vector.double().reshape(-1, s.shape[1])
        proj = s @ torch.linalg.pinv(d) @ d  # [n, hidden]
        return (-self.weight(s, prompt_len, ctx) * proj).to(stream.dtype)


@dataclass
class HFClamp(HFSteer):
    """``clamp``: the SAE's whole encode (``sae``: W_enc, b_enc, b_dec, threshold), latent
    ``feature`` set to ``value``, decoded, the error term kept: ``x - dec(f) + dec(f')``."""

    sae: dict | None = None
    feature: int = 0
    value: float = 0.0

    def delta(self, stream, prompt_len, ctx=None):
        t = {k: v.double() for k, v in self.sae.items()}
        s = stream.double()
        pre = (s - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
        f = torch.relu(pre) * (pre > t["threshold"])
        g = f.clone()
        g[:, self.feature] = self.value
        change = (g - f) @ t["W_dec"]  # dec(f') - dec(f): b_dec cancels
        return (self.weight(s, prompt_len, ctx) * change).to(stream.dtype)


@dataclass
class HFScale(HFSteer):
    """The oracle of a user hook returning ``factor * rows`` at every token."""

    factor: float = 1.0

    def delta(self, stream, prompt_len, ctx=None):
        return (self.factor - 1.0) * stream


def write_sae(
    path,
    hidden: int,
    d_sae: int,
    seed: int,
    arch: str = "jumprelu",
    *,
    apply_b_dec_to_input: bool = True,
) -> dict[str, torch.Tensor]:
    """An SAE checkpoint of ``arch`` in SAELens' inference format, written by hand into
    the new directory ``path``; returns what ``HFClamp`` encodes with: a ReLU SAE's
    threshold is 0, and an SAE that does not subtract ``b_dec`` from its input encodes
    as one whose ``b_dec`` is 0 (decoding differences cancel it)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    t = {
        "W_enc": torch.randn(hidden, d_sae, generator=g) / hidden**0.5,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1,
        "b_dec": torch.randn(hidden, generator=g) * 0.1,
        "W_dec": torch.randn(d_sae, hidden, generator=g) / d_sae**0.5,
        "threshold": torch.rand(d_sae, generator=g) * 0.05,
    }
    stored = t if arch == "jumprelu" else {k: v for k, v in t.items() if k != "threshold"}
    path.mkdir()
    save_file(stored, str(path / "sae_weights.safetensors"))
    cfg = {"architecture": arch, "d_in": hidden, "d_sae": d_sae}
    cfg.update(apply_b_dec_to_input=apply_b_dec_to_input, **({"k": 4} if arch == "topk" else {}))
    (path / "cfg.json").write_text(json.dumps(cfg))
    oracle = dict(t)
    if arch != "jumprelu":
        oracle["threshold"] = torch.zeros(d_sae)
    if not apply_b_dec_to_input:
        oracle["b_dec"] = torch.zeros(hidden)
    return oracle


def check_hf(
    out,
    path,
    steers: list[HFSteer],
    max_tokens: int,
    layers: list[int],
    hooks: list[str],
    positions: str = "all",
    sample: int = 0,
    tol: float = 1e-3,
) -> tuple[list[int], dict]:
    """An engine's output (its ``sample``-th completion) against HF with the same
    operations hooked in: the greedy tokens, and every returned row (``positions``:
    all fed tokens, or the generated ones) of ``layers`` x ``hooks`` within ``tol``."""
    prompt = list(out.prompt_token_ids)
    want_tokens, want = hf_steered_greedy(path, prompt, max_tokens, steers, layers)
    got_tokens = list(out.outputs[sample].token_ids)
    assert got_tokens == want_tokens, (steers, got_tokens, want_tokens)
    acts = out.outputs[sample].activations
    assert acts is not None and acts.complete
    fed = len(prompt) + max_tokens - 1
    rows = list(range(fed)) if positions == "all" else list(range(len(prompt), fed))
    assert acts.positions.tolist() == rows
    for layer in layers:
        for hook in hooks:
            err = max_rel_error(acts[(layer, hook)], want[(layer, hook)][rows])
            assert err <= tol, (layer, hook, err, steers)
    return got_tokens, want


def ops_params(steer=None, *, max_tokens: int, ret="all", n: int = 1, hooks=None):
    """Greedy ``SamplingParams`` with ``steer`` entries (and user ``hooks``), returning
    the rows of ``ret`` positions (None: none); ``n > 1`` samples with top_k 1."""
    from vllm import SamplingParams

    actbus: dict = {} if steer is None else {"steer": steer}
    if hooks:
        actbus["user_hooks"] = hooks
    if ret is not None:
        actbus.update({"return": True, "positions": ret})
    sampling = {"temperature": 0} if n == 1 else {"temperature": 1.0, "top_k": 1}
    return SamplingParams(
        n=n, max_tokens=max_tokens, ignore_eos=True, extra_args={"actbus": actbus}, **sampling
    )
