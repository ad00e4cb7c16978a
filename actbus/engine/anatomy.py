"""The anatomy of a loaded model: where its decoder layers are, and what form they have.

Found by structure, not from a list of architectures. The language model is the model
itself or, in a multimodal wrapper, what its ``get_language_model()`` returns; its
decoder layers are the one ``nn.ModuleList`` of ``num_hidden_layers`` entries there.
Each layer's form is read from its class's ``forward`` (its source, parsed, never run):

- ``residual``: vLLM's ``(positions, hidden_states, residual) -> (hidden_states,
  residual)``, where the first layer gets ``residual=None`` (``if residual is None``),
  the norm before the MLP adds ``hidden_states`` into ``residual`` (a call
  ``self.<norm>(hidden_states, residual)`` after the input norm's), and the layer
  returns ``(what the MLP block adds, the stream after attention)``. Llama, Mistral,
  Qwen 2/3, Gemma 2/3, Phi-3 and the mixture-of-experts families (Mixtral, Qwen2-MoE,
  Qwen3-MoE, OLMoE, DeepSeek-V2, whose ``mlp_out`` is the whole MoE block's output)
  read so. gpt-oss's layer (and Bailing-MoE v3's, Param2MoE's, Sarvam's) is the same
  form with its first two arguments the other way round, ``(hidden_states, positions,
  residual)`` (``stream_first``); its attention sinks and its MoE block sit inside
  attention and the MLP, so no hook point moves.
  ``actbus.engine.layers.wrap_layer`` reads the hook points off its inputs and
  outputs; ``post_attn`` is steered through that norm (``post_attn_norm``).
- ``parallel``: the residual form with no norm between attention and the MLP (they
  run side by side on the same input): the stream after attention alone never exists,
  so ``post_attn`` and ``mlp_out`` are refused by name.
- named adapters for families that depart (``ADAPTERS``): each rewrites the layer's
  forward in the residual form from the layer's own modules, in vLLM's order of
  operations, so every hook point exists. ``granite``: vLLM's Granite layer,
  ``(positions, hidden_states) -> hidden_states`` with ``residual_multiplier``;
  ``olmo2``: HF's OLMo 2 layer as vLLM's Transformers backend runs it (norms after
  attention and after the MLP, no norm before either).

Anything else fails at start, naming what was found and what was expected.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from actbus.errors import ConfigError
from actbus.steer.graph import steer_point
from actbus.streams import HOOKS

RESIDUAL_FORM = (
    "(positions, hidden_states, residual) -> (hidden_states, residual) (or the first two "
    "arguments the other way round), with "
    "'if residual is None' for the first layer, a norm called as "
    "self.<norm>(hidden_states, residual) before the MLP, and 'return hidden_states, residual' "
    "(what the MLP block adds under any name, then the residual)"
)


@dataclass(frozen=True)
class LayerForm:
    """What ``wrap_layer`` needs of a decoder layer's form."""

    name: str
    """``residual``, ``parallel``, or an adapter's name (``ADAPTERS``)."""
    post_attn_norm: str | None = None
    """The residual form's norm that adds attention's output into the stream (where
    ``post_attn`` is steered); None where the form steers it itself."""
    lacks: dict[str, str] = field(default_factory=dict)
    """Hook -> why this form has no such point."""
    adapter: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """``adapter(layer, inner, args, kwargs, stream) -> (mlp_out, post_attn)``: the
    layer's work in the residual form (None: the layer is in it already); ``stream`` is
    ``[tokens, hidden]`` (an HF layer's batch of one taken off by ``wrap_layer``)."""
    stream_arg: int = 1
    """Where the stream is among the layer's positional arguments (an adapter's)."""
    stream_first: bool = False
    """The residual form called ``(hidden_states, positions, residual)`` (gpt-oss's
    order), not ``(positions, hidden_states, residual)``."""

    @property
    def hooks(self) -> tuple[str, ...]:
        return tuple(h for h in HOOKS if h not in self.lacks)


RESIDUAL = LayerForm("residual", post_attn_norm="post_attention_layernorm")
"""The residual form as Llama's layers have it."""


@dataclass(frozen=True)
class Anatomy:
    """A model's decoder layers and their one form."""

    path: str
    """Where the list is, from the model's root (``language_model.model.layers``)."""
    layers: nn.ModuleList
    form: LayerForm
    layer_class: str

    def owned(self, layers: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The layers of ``layers`` this pipeline stage computes (the others are vLLM's
        placeholders for another stage's)."""
        return tuple(i for i in layers if type(self.layers[i]).__name__ != "PPMissingLayer")

    def check_hooks(self, hooks: tuple[str, ...] | list[str], where: str) -> None:
        """Refuse, by name, a hook this model's layers do not have."""
        for h in hooks:
            if h in self.form.lacks:
                raise ConfigError(
                    f"{where}: hook {h!r} does not exist in {self.layer_class} "
                    f"(form {self.form.name!r}): {self.form.lacks[h]}; this model has "
                    f"{list(self.form.hooks)}"
                )


def language_model(model: nn.Module) -> tuple[str, nn.Module]:
    """The text model inside a multimodal wrapper (its path), or the model itself."""
    get = getattr(model, "get_language_model", None)
    if callable(get):
        try:
            lm = get()
        except Exception:  # a wrapper that cannot say: search all of it
            lm = None
        if isinstance(lm, nn.Module) and lm is not model:
            for name, mod in model.named_modules():
                if mod is lm:
                    return name, lm
    return "", model


def find_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The decoder-layer list of ``model``'s language model, and its path."""
    prefix, lm = language_model(model)
    found = [
        (name, mod)
        for name, mod in lm.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers and len(mod) > 0
    ]
    if len(found) > 1:  # e.g. a vision tower inside it: the decoder's is named *layers
        named = [(n, m) for n, m in found if n.endswith("layers")]
        found = named if len(named) == 1 else found
    if len(found) != 1:
        lists = [f"{n} ({len(m)})" for n, m in lm.named_modules() if isinstance(m, nn.ModuleList)]
        raise ConfigError(
            f"actbus: could not find the decoder layers of {type(model).__name__}: expected "
            f"one list of {num_layers} layers (num_hidden_layers) in its language model "
            f"{type(lm).__name__}, found {'; '.join(lists[:8]) or 'no module lists'}; this "
            "model is not supported for capture"
        )
    name, layers = found[0]
    return ".".join(p for p in (prefix, name) if p), layers


def anatomy(model: nn.Module, num_layers: int) -> Anatomy:
    """The model's decoder layers and their form, or a ConfigError saying what was
    found and what was expected."""
    path, layers = find_layers(model, num_layers)
    real = [m for m in layers if type(m).__name__ != "PPMissingLayer"]  # other PP stages'
    classes = {type(m) for m in real}
    if len(classes) != 1:
        names = sorted(c.__name__ for c in classes) or ["only placeholders"]
        raise ConfigError(
            f"actbus: the decoder layers at {path} of {type(model).__name__} are of "
            f"{len(names)} classes ({', '.join(names)}); expected one layer class"
        )
    cls = classes.pop()
    return Anatomy(path, layers, layer_form(cls), f"{cls.__module__}.{cls.__qualname__}")


@functools.lru_cache(maxsize=64)
def layer_form(cls: type) -> LayerForm:
    """The form of a decoder-layer class (``ConfigError`` if it fits none)."""
    for match, form in ADAPTERS:
        if match(cls):
            return form
    found = _read_forward(cls)
    if isinstance(found, str):
        raise _unfit(cls, found)
    return found


def _unfit(cls: type, found: str) -> ConfigError:
    return ConfigError(
        f"actbus: decoder layer {cls.__module__}.{cls.__qualname__} fits no form actbus "
        f"reads: found {found}; expected vLLM's residual form {RESIDUAL_FORM}, or one of the "
        f"named adapters ({', '.join(f.name for _, f in ADAPTERS)}); this model is not "
        "supported for capture (docs/families.md)"
    )


def _read_forward(cls: type) -> LayerForm | str:
    """The residual or parallel form from ``cls.forward``'s source, or what was found."""
    fwd = getattr(cls, "forward", None)
    try:
        params = list(inspect.signature(fwd).parameters)[1:]
        src = textwrap.dedent(inspect.getsource(fwd))
        tree = ast.parse(src).body[0]
    except (TypeError, OSError, SyntaxError, IndexError, ValueError):
        return "a forward whose signature or source cannot be read"
    return form_of(params, tree)


def form_of(params: list[str], tree: ast.AST) -> LayerForm | str:
    """The residual or parallel form of a forward (its parameters after ``self``, its
    parsed source), or what was found instead."""
    sig = f"forward({', '.join(params)})"
    first = _ORDERS.get(tuple(params[:3]))
    if first is None:
        return sig
    nodes = list(ast.walk(tree))
    returns = [n for n in nodes if isinstance(n, ast.Return)]
    if not returns or not all(_returns_streams(r.value) for r in returns):
        got = [ast.unparse(r.value) if r.value else "None" for r in returns]
        return f"{sig} returning {', '.join(got) or 'nothing'}"
    if not any(isinstance(n, ast.If) and _is_none_test(n.test) for n in nodes):
        return f"{sig} that never tests 'residual is None' (it does not read the stream so)"
    calls = sorted(
        (n for n in nodes if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)
    )
    fused = [f for f in map(_fused_norm, calls) if f is not None]  # in source order
    fused = sorted(set(fused), key=fused.index)
    if len(fused) >= 2:  # the input norm's, then the one before the MLP
        return LayerForm("residual", post_attn_norm=fused[-1], stream_first=first)
    why = (
        "attention and the MLP run side by side on the same input (no norm adds "
        "attention's output into the stream before the MLP), so no stream after "
        "attention alone exists"
    )
    return LayerForm("parallel", lacks={"post_attn": why, "mlp_out": why}, stream_first=first)


_ORDERS = {
    ("positions", "hidden_states", "residual"): False,
    ("hidden_states", "positions", "residual"): True,  # gpt-oss's order
}
"""The residual form's first three parameters -> ``LayerForm.stream_first``."""


def _returns_streams(node: ast.AST | None) -> bool:
    """``return <name>, residual``: what the MLP block adds (``hidden_states``; gpt-oss
    names it ``output``), then the stream after attention."""
    names = _names(node)
    return len(names) == 2 and names[0] != "?" and names[1] == "residual"


def _names(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [e.id if isinstance(e, ast.Name) else "?" for e in node.elts]
    return []


def _is_none_test(test: ast.AST) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "residual"
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


def _fused_norm(call: ast.Call) -> str | None:
    """``norm`` of a call ``self.norm(x, residual)`` (or ``residual=residual``)."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)):
        return None
    if f.value.id != "self":
        return None
    args = [a.id for a in call.args if isinstance(a, ast.Name)]
    kw = {k.arg for k in call.keywords}
    if (len(call.args) == 2 and args[-1:] == ["residual"]) or "residual" in kw:
        return f.attr
    return None


# --- named adapters: each is the layer's forward in the residual form, in vLLM's order ---


def _steered(layer: nn.Module, stream: torch.Tensor) -> torch.Tensor:
    """The stream after attention, steered at ``post_attn`` where the layer steers there."""
    if "post_attn" in getattr(layer, "_actbus_steer_hooks", ()):
        return steer_point(layer, "post_attn", stream, stream)
    return stream


def _granite(layer, inner, args, kwargs, stream):
    """vLLM's ``GraniteDecoderLayer.forward`` (``vllm/model_executor/models/granite.py``)."""
    positions = args[0] if args else kwargs["positions"]
    rm = layer.residual_multiplier
    h = layer.self_attn(positions=positions, hidden_states=layer.input_layernorm(stream))
    resid = _steered(layer, stream + h * rm)
    return layer.mlp(layer.post_attention_layernorm(resid)) * rm, resid


def _olmo2(layer, inner, args, kwargs, stream):
    """HF's ``Olmo2DecoderLayer.forward`` (transformers' ``modeling_olmo2.py``), which
    vLLM's Transformers backend runs with its own attention."""
    if args[1:]:
        raise RuntimeError("actbus: OLMo 2's layer was called with positional arguments")
    h, _ = layer.self_attn(hidden_states=stream[None], **kwargs)  # HF's batch of one
    h = h[0]
    resid = _steered(layer, stream + layer.post_attention_layernorm(h))
    return layer.post_feedforward_layernorm(layer.mlp(resid)), resid


def _is(module: str, *names: str) -> Callable[[type], bool]:
    return lambda cls: cls.__module__ == module and cls.__name__ in names


ADAPTERS: tuple[tuple[Callable[[type], bool], LayerForm], ...] = (
    (
        _is("vllm.model_executor.models.granite", "GraniteDecoderLayer"),
        LayerForm("granite", adapter=_granite, stream_arg=1),
    ),
    (
        _is("transformers.models.olmo2.modeling_olmo2", "Olmo2DecoderLayer"),
        LayerForm("olmo2", adapter=_olmo2, stream_arg=0),
    ),
)
"""(which layer classes, their form): the families that depart from the residual form."""
