"""What users write to monitor: the engine's ``actbus.monitor`` entry and a request's
``monitor`` keys, parsed and checked once (no model, no files: ``weights`` loads them).

The engine declares named monitors and where each is evaluated::

    "monitor": {
        "monitors": {
            "toxic": {"probe": "runs/probe-l2", "head": "label", "layers": [2]},
            "feats": {"sae": "runs/sae-l1", "features": [3, 17], "layers": [1]},
            "raw": {"weight": [0.1, ...], "bias": 0.0, "sigmoid": True, "layers": [0, 1],
                    "hook": "pre_attn"},
        },
        "global": ["toxic"],
    }

The points are fixed when the engine starts (they shape the compiled graph); the
weights live in persistent device tables, so changing them never recompiles.
A request selects monitors by name: ``{"monitor": ["toxic"], "monitor_global": false}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actbus.errors import ConfigError
from actbus.fields import check_finite, check_name, source_kind
from actbus.streams import HOOKS, parse_layers

SOURCE_KINDS = ("probe", "sae", "weight")
MONITOR_KEYS = {
    "probe": ("probe", "head", "sigmoid", "layers", "hook"),
    "sae": ("sae", "features", "layers", "hook"),
    "weight": ("weight", "bias", "sigmoid", "layers", "hook"),
}
MAX_MONITORS = 64
MAX_FEATURES = 4096
"""SAE features one monitor scores (its message's width)."""


@dataclass(frozen=True, eq=False)
class MonitorDef:
    """One named monitor as configured: its source and its points (checked for form;
    files are read and layers checked against the model when the engine starts)."""

    name: str
    kind: str  # "probe" | "sae" | "weight"
    layers: tuple[int, ...]
    hook: str = "post_block"
    path: str | None = None
    head: str | None = None
    features: tuple[int, ...] = ()
    weight: tuple[float, ...] = ()
    bias: float = 0.0
    sigmoid: bool | None = None
    """None: the source's own reading (a logistic probe's is a probability)."""

    @property
    def points(self) -> list[tuple[int, str]]:
        return [(layer, self.hook) for layer in self.layers]

    @classmethod
    def from_dict(cls, name: str, raw: Any, where: str) -> MonitorDef:
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{where}: expected a mapping such as {{'probe': DIR, 'layers': [2]}}, "
                f"{{'sae': DIR, 'features': [3], 'layers': [1]}} or "
                f"{{'weight': [...], 'bias': 0.0, 'layers': [0]}}, got {raw!r:.80}"
            )
        kind = source_kind(raw, SOURCE_KINDS, where)
        for k in raw:
            if k not in MONITOR_KEYS[kind]:
                raise ConfigError(
                    f"{where}.{k}: unknown key for a {kind} monitor; valid: "
                    f"{', '.join(MONITOR_KEYS[kind])}"
                )
        if "layers" not in raw:
            raise ConfigError(f"{where}.layers: required (the layers it is evaluated at)")
        kw: dict[str, Any] = {
            "layers": parse_layers(raw["layers"], f"{where}.layers", or_all=False)
        }
        hook = raw.get("hook", "post_block")
        if hook not in HOOKS:
            raise ConfigError(
                f"{where}.hook: {hook!r:.40} is not a hook; use one of {', '.join(HOOKS)}"
            )
        kw["hook"] = hook
        if "sigmoid" in raw:
            if not isinstance(raw["sigmoid"], bool):
                raise ConfigError(
                    f"{where}.sigmoid: expected true or false, got {raw['sigmoid']!r:.40}"
                )
            kw["sigmoid"] = raw["sigmoid"]
        if kind in ("probe", "sae"):
            path = raw[kind]
            if not isinstance(path, str) or not path:
                raise ConfigError(
                    f"{where}.{kind}: expected a checkpoint directory, got {path!r:.60}"
                )
            kw["path"] = path
        if kind == "probe" and "head" in raw:
            if not isinstance(raw["head"], str):
                raise ConfigError(f"{where}.head: expected a label name, got {raw['head']!r:.40}")
            kw["head"] = raw["head"]
        if kind == "sae":
            feats = raw.get("features")
            if isinstance(feats, int) and not isinstance(feats, bool):
                feats = [feats]
            if not isinstance(feats, list) or not feats or len(feats) > MAX_FEATURES:
                raise ConfigError(
                    f"{where}.features: expected a non-empty list of at most {MAX_FEATURES} "
                    f"latent indices, got {feats!r:.60}"
                )
            for i, f in enumerate(feats):
                if not isinstance(f, int) or isinstance(f, bool) or f < 0:
                    raise ConfigError(
                        f"{where}.features[{i}]: expected a latent index (int >= 0), got {f!r:.40}"
                    )
            if len(set(feats)) != len(feats):
                raise ConfigError(f"{where}.features: lists a latent twice")
            kw["features"] = tuple(feats)
        if kind == "weight":
            w = raw["weight"]
            if not isinstance(w, list) or not w:
                raise ConfigError(f"{where}.weight: expected a list of hidden_size floats")
            kw["weight"] = tuple(
                check_finite(x, f"{where}.weight[{j}]", "a weight") for j, x in enumerate(w)
            )
            kw["bias"] = check_finite(raw.get("bias", 0.0), f"{where}.bias", "a bias")
        return cls(name=name, kind=kind, **kw)


@dataclass(frozen=True, eq=False)
class MonitorConfig:
    """The engine's ``actbus.monitor``: named monitors (each adds a few operations to the
    compiled graph at its points, whether a request asks or not) and the global ones
    every request gets unless it opts out."""

    monitors: dict[str, MonitorDef] = field(default_factory=dict)
    global_monitors: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: Any, where: str = "actbus.monitor") -> MonitorConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{'monitors': {{...}}}}")
        for k in raw:
            if k not in ("monitors", "global"):
                raise ConfigError(f"{where}.{k}: unknown key; valid keys are monitors, global")
        mons = raw.get("monitors", {})
        if not isinstance(mons, dict) or not mons:
            raise ConfigError(
                f"{where}.monitors: expected a non-empty mapping of names to monitors"
            )
        if len(mons) > MAX_MONITORS:
            raise ConfigError(f"{where}.monitors: {len(mons)} monitors; at most {MAX_MONITORS}")
        defs = {
            check_name(n, f"{where}.monitors"): MonitorDef.from_dict(n, m, f"{where}.monitors.{n}")
            for n, m in mons.items()
        }
        glob = parse_names(raw.get("global", []), f"{where}.global", tuple(defs), allow_empty=True)
        return cls(defs, glob)

    def check_model(self, num_layers: int, where: str = "actbus.monitor") -> None:
        """Every monitor's layers exist in the model."""
        for name, d in self.monitors.items():
            parse_layers(list(d.layers), f"{where}.monitors.{name}.layers", num_layers=num_layers)

    def request(self, raw: Any, use_global: Any, where: str) -> tuple[str, ...]:
        """A request's monitors: its own names (``raw``, None if it gave none) after the
        global ones unless ``use_global`` is false."""
        if not isinstance(use_global, bool):
            raise ConfigError(
                f"{where}_global: expected true or false (false: no global monitors), "
                f"got {use_global!r:.40}"
            )
        own = parse_names(raw, where, tuple(self.monitors)) if raw is not None else ()
        return tuple(dict.fromkeys((self.global_monitors if use_global else ()) + own))


def parse_names(
    raw: Any, where: str, known: tuple[str, ...], *, allow_empty: bool = False
) -> tuple[str, ...]:
    """A monitor name or a list of them, each one the engine has."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or (not raw and not allow_empty):
        raise ConfigError(f"{where}: expected a monitor name or a list of them, got {raw!r:.60}")
    for i, n in enumerate(raw):
        if not isinstance(n, str) or n not in known:
            listed = ", ".join(sorted(known)[:20]) or "none configured"
            raise ConfigError(
                f"{where}[{i}]: no monitor named {n!r:.60} on this engine (known: {listed}); "
                "add it to the engine's actbus.monitor.monitors"
            )
    return tuple(dict.fromkeys(raw))
