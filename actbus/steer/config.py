"""What users write to steer: the engine's ``actbus.steer`` entry and a request's
``steer`` list, parsed and checked once (no model, no files: ``vectors`` loads them).

A steering entry adds one vector at some decoder layers and hook points::

    {"vector": "happy", "layers": [3], "hooks": "post_block", "scale": 4.0,
     "norm_match": false, "tier": "base", "positions": "all"}

``vector`` is a registered name or the vector itself (a list of ``hidden_size``
floats). ``tier`` says in which phase it applies: ``base`` (every token), ``prefill``
(prompt tokens) or ``decode`` (generated tokens); ``positions`` narrows it further,
as in capture selections. With ``norm_match`` the vector is rescaled per token to
``scale x ||stream||``, the norm of the residual stream at that point. With ``gate``
the vector is multiplied, per token, by a gate read off a monitor's score (``Gate``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from actbus.errors import ConfigError
from actbus.fields import FLOAT32_MAX, check_finite, check_name, source_kind
from actbus.streams import STEER_HOOKS, parse_hooks, parse_layers, parse_positions, show_int

TIERS = ("base", "prefill", "decode")
ENTRY_KEYS = ("vector", "layers", "hooks", "scale", "norm_match", "tier", "positions", "gate")
OPS = ("add", "replace", "ablate", "clamp")
"""The operations a steering entry can do (``op``; ``add`` when absent)."""
OP_KEYS = {
    "add": ENTRY_KEYS,
    "replace": ("op", "vector", "rows", "layers", "hooks", "tier", "positions", "gate"),
    "ablate": ("op", "directions", "layers", "hooks", "tier", "positions", "gate"),
    "clamp": ("op", "sae", "feature", "value", "layers", "hooks", "tier", "positions", "gate"),
}
MAX_ROWS = 2048
"""Rows one request's ``replace`` entries carry in all (each is one row of the device
table while the request runs); counted before any row is converted."""
MAX_DIRECTIONS = 16
"""Directions one ``ablate`` entry projects out at most."""
DEFAULT_REQUEST_ROWS = 64
"""``max_request_vectors`` unset: at most this many, and at most an eighth of the table."""
GATE_KEYS = ("monitor", "layer", "feature", "threshold", "sharpness", "source")
GATE_SOURCES = ("token", "previous")
# Where each point runs inside a decoder layer (``actbus.engine.layers.wrap_layer``):
# steering at a point comes before the monitor there, so a monitor reads the steered
# stream; post_attn steering runs inside the layer, before the post_attn monitor.
_STEER_RANK = {"pre_attn": 0, "post_attn": 2, "post_block": 5}
_MONITOR_RANK = {"pre_attn": 1, "post_attn": 3, "mlp_out": 4, "post_block": 6}


def monitor_runs_before(monitor: tuple[int, str], steer: tuple[int, str]) -> bool:
    """Whether a monitor at ``monitor`` (layer, hook) is scored, in one forward, before
    steering at ``steer`` is added: only then can a gate read the same token's score."""
    return (monitor[0], _MONITOR_RANK[monitor[1]]) < (steer[0], _STEER_RANK[steer[1]])


SOURCE_KINDS = ("file", "sae", "probe")
ADMIN_KEY_ENV = "ACTBUS_ADMIN_KEY"
"""The server's environment variable holding the key the steering endpoints ask for."""
# (tier, positions) pairs that select no token at all.
_EMPTY = (("prefill", "generated"), ("decode", "prompt"), ("decode", "last_prompt"))
MAX_ENTRIES = 64
"""Entries one request may carry (after layers and hooks are expanded); counted before
anything is expanded or converted, so a hostile list costs no more than this."""
MAX_LIST = 4096
"""Items of an entry's ``layers``, ``hooks`` or ``positions`` list, checked before they
are read (a model has fewer layers; positions beyond: steer by tier)."""
MAX_VECTOR_WIDTH = 1 << 17
"""Components of an inline vector, checked before it is converted (no residual stream
is wider; the model's own width is checked where it is known)."""


@dataclass(frozen=True)
class Gate:
    """A steering entry's gate: the vector is multiplied by ``g(score)`` per token, where
    ``score`` is column ``feature`` (SAE monitors) of monitor ``monitor`` at ``layer``,
    read off the same token (``source="token"``: the monitor must run before the
    steered point) or off the token before it (``"previous"``). ``g`` is a hard
    threshold (``score > threshold``: 1, else 0) when ``sharpness`` is None, else
    ``sigmoid(sharpness * (score - threshold))``."""

    monitor: str
    threshold: float
    layer: int | None = None
    """None: the monitor's only layer (required when it has several)."""
    feature: int | None = None
    """An SAE monitor's latent (one of its ``features``); None for probes and weights."""
    sharpness: float | None = None
    source: str = "token"

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> Gate:
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{where}: expected a mapping such as {{'monitor': 'toxic', 'threshold': 0.5}}, "
                f"got {raw!r:.60}"
            )
        for k in raw:
            if k not in GATE_KEYS:
                raise ConfigError(
                    f"{where}.{k}: unknown key; valid keys are {', '.join(GATE_KEYS)}"
                )
        for k in ("monitor", "threshold"):
            if k not in raw:
                raise ConfigError(f"{where}.{k}: required")
        monitor = check_name(raw["monitor"], f"{where}.monitor")
        threshold = check_finite(raw["threshold"], f"{where}.threshold", "a threshold")
        for k in ("layer", "feature"):
            v = raw.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"{where}.{k}: expected an int >= 0 or null, got {v!r:.40}")
        sharpness = raw.get("sharpness")
        if sharpness is not None:
            sharpness = check_finite(sharpness, f"{where}.sharpness", "a sharpness")
            if sharpness == 0.0:
                raise ConfigError(
                    f"{where}.sharpness: 0 makes the gate a constant 0.5; give a non-zero "
                    "number (negative: open below the threshold) or null for a hard threshold"
                )
        source = raw.get("source", "token")
        if source not in GATE_SOURCES:
            raise ConfigError(
                f"{where}.source: expected 'token' (this token's score at an earlier point) or "
                f"'previous' (the token before's), got {source!r:.40}"
            )
        return cls(monitor, threshold, raw.get("layer"), raw.get("feature"), sharpness, source)


@dataclass(frozen=True, eq=False)
class SteerSpec:
    """One vector at one (layer, hook), checked but not resolved: ``vector`` is a name
    or the values as given."""

    layer: int
    hook: str
    vector: str | np.ndarray
    scale: float = 1.0
    norm_match: bool = False
    tier: str = "base"
    positions: str | tuple[int, ...] = "all"
    gate: Gate | None = None
    op: str = "add"
    """``add``; ``replace`` (``vector`` is the row the token's stream becomes);
    ``ablate`` (``directions``, projected out); ``clamp`` (``sae``'s ``feature`` set to
    ``value``, the SAE's error term kept)."""
    directions: tuple[str | np.ndarray, ...] = ()
    sae: str = ""
    feature: int = 0
    value: float = 0.0
    entry: int = field(default=-1, compare=False)
    """The index of the request's entry this spec expands (-1: not from a list);
    errors name the entry, not the expanded spec."""
    key: str = field(default="vector", compare=False)
    """The entry's key that gave ``vector``: ``vector``, or ``rows[j]`` of a ``replace``."""

    @property
    def point(self) -> tuple[int, str]:
        return (self.layer, self.hook)


@dataclass(frozen=True)
class VectorSource:
    """Where a named vector comes from: a safetensors file (``key`` names the tensor;
    optional when the file holds one), feature ``feature`` of an SAE checkpoint (its
    unit decoder row), or head ``head`` of a probe checkpoint (its unit direction)."""

    kind: str
    path: str
    key: str | None = None
    feature: int | None = None
    head: str | None = None

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> VectorSource:
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{where}: expected a mapping such as {{'file': 'v.safetensors', 'key': 'v'}}, "
                f"{{'sae': DIR, 'feature': 12}} or {{'probe': DIR}}, got {raw!r:.80}"
            )
        kind = source_kind(raw, SOURCE_KINDS, where)
        allowed = {"file": ("key",), "sae": ("feature",), "probe": ("head",)}[kind]
        for k in raw:
            if k != kind and k not in allowed:
                raise ConfigError(
                    f"{where}.{k}: unknown key for a {kind} source; valid: {kind}, "
                    f"{', '.join(allowed)}"
                )
        path = raw[kind]
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.{kind}: expected a path, got {path!r}")
        feature = raw.get("feature")
        if kind == "sae" and (
            not isinstance(feature, int) or isinstance(feature, bool) or feature < 0
        ):
            raise ConfigError(
                f"{where}.feature: expected a latent index (int >= 0), got {feature!r}"
            )
        for k in ("key", "head"):
            if k in raw and not isinstance(raw[k], str):
                raise ConfigError(f"{where}.{k}: expected a string, got {raw[k]!r}")
        return cls(kind, path, raw.get("key"), feature, raw.get("head"))


@dataclass(frozen=True, eq=False)
class SteerConfig:
    """The engine's ``actbus.steer``: which points can be steered (each adds a few
    operations to the compiled graph, steered or not), the tables' sizes, named vectors
    and the global steering every request gets unless it opts out."""

    layers: tuple[int, ...] = ()
    all_layers: bool = True
    """``layers`` unset or ``"all"``: every decoder layer can be steered."""
    hooks: tuple[str, ...] = ("post_block",)
    per_token: int = 4
    """Vectors added to one token at one point, at most (global and own together)."""
    max_vectors: int = 0
    """Rows of the device table of vectors in use; 0: 8 per running request, plus one."""
    max_request_vectors: int = 0
    """Distinct vectors (table rows) one request may hold, global ones included; 0: an
    eighth of the table's usable rows, at most 64. A request past it is refused."""
    vectors: dict[str, VectorSource] = field(default_factory=dict)
    live: dict[str, VectorSource | None] = field(default_factory=dict)
    """Live vectors: names whose values pushes over the control endpoint replace while
    serving (``actbus.steer.live``), each with its first values (None: zeros)."""
    global_steer: tuple[dict[str, Any], ...] = ()
    """Entries as written (checked for form; layers and names are checked against the
    model when the engine starts)."""
    vector_dirs: tuple[str, ...] = ()
    """Directories whose files HTTP callers may register vectors from (``{"file": ...}``,
    ``{"sae": ...}``, ``{"probe": ...}``); none: HTTP callers register values only."""
    max_named: int = 4096
    """Named vectors the engine holds at most."""
    ops: tuple[str, ...] = ("add",)
    """The operations requests may use (``OPS``). ``add`` is always there; ``ablate``
    and ``clamp`` add a projection per slot to every steerable point's graph, and
    ``replace`` one more term: an engine pays for them only when it lists them."""

    @classmethod
    def from_dict(cls, raw: Any, where: str = "actbus.steer") -> SteerConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{'layers': [3]}}")
        known = (
            "layers",
            "hooks",
            "per_token",
            "max_vectors",
            "max_request_vectors",
            "vectors",
            "live",
            "global",
            "vector_dirs",
            "max_named",
            "ops",
        )
        for k in raw:
            if k not in known:
                raise ConfigError(f"{where}.{k}: unknown key; valid keys are {', '.join(known)}")
        kw: dict[str, Any] = {}
        layers = raw.get("layers", "all")
        if layers != "all":
            kw["layers"] = parse_layers(layers, f"{where}.layers")
            kw["all_layers"] = False
        if "hooks" in raw:
            kw["hooks"] = parse_hooks(raw["hooks"], f"{where}.hooks", steerable=STEER_HOOKS)
        for name, lo, hi in (
            ("per_token", 1, 64),
            ("max_vectors", 0, 1 << 20),
            ("max_request_vectors", 0, 1 << 20),
            ("max_named", 1, 1 << 16),
        ):
            if name in raw:
                v = raw[name]
                if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                    raise ConfigError(
                        f"{where}.{name}: expected an integer in {lo}..{hi}, got {v!r}"
                    )
                kw[name] = v
        vectors = raw.get("vectors", {})
        if not isinstance(vectors, dict):
            raise ConfigError(f"{where}.vectors: expected a mapping of names to sources")
        kw["vectors"] = {
            check_name(n, f"{where}.vectors"): VectorSource.from_dict(s, f"{where}.vectors.{n}")
            for n, s in vectors.items()
        }
        kw["live"] = _live(raw.get("live", {}), f"{where}.live")
        for n in kw["live"]:
            if n in kw["vectors"]:
                raise ConfigError(
                    f"{where}.live.{n}: also a named vector ({where}.vectors); a name is either "
                    "registered (fixed values) or live (pushed values), not both"
                )
        dirs = raw.get("vector_dirs", [])
        if isinstance(dirs, str):
            dirs = [dirs]
        if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
            raise ConfigError(
                f"{where}.vector_dirs: expected a list of directories, e.g. ['/srv/vectors']"
            )
        for i, d in enumerate(dirs):
            if not os.path.isabs(os.path.expanduser(d)):
                raise ConfigError(f"{where}.vector_dirs[{i}]: {d!r:.200} is not an absolute path")
        kw["vector_dirs"] = tuple(os.path.expanduser(d) for d in dirs)
        if "ops" in raw:
            ops = raw["ops"]
            if isinstance(ops, str):
                ops = [ops]
            if not isinstance(ops, list) or not all(o in OPS for o in ops):
                raise ConfigError(
                    f"{where}.ops: expected a list of operations from {', '.join(OPS)}, "
                    f"got {ops!r:.80}"
                )
            kw["ops"] = tuple(o for o in OPS if o == "add" or o in ops)
        glob = raw.get("global", [])
        parse_steer(glob, f"{where}.global")  # the form; the model is checked later
        kw["global_steer"] = tuple(glob)
        return cls(**kw)

    def table_rows(self, max_num_seqs: int) -> int:
        """Rows of the device table (row 0 stays zero: one fewer is usable)."""
        return self.max_vectors or 8 * max_num_seqs + 1

    def request_rows(self, max_num_seqs: int) -> int:
        """Distinct vectors one request may hold; a ConfigError when set past the table."""
        usable = self.table_rows(max_num_seqs) - 1
        if not self.max_request_vectors:
            return max(1, min(DEFAULT_REQUEST_ROWS, usable // 8))
        if self.max_request_vectors > usable:
            raise ConfigError(
                f"actbus.steer.max_request_vectors: {self.max_request_vectors} is more than "
                f"the steering table's {usable} usable rows (actbus.steer.max_vectors, or 8 "
                "per max_num_seqs); lower it or raise max_vectors"
            )
        return self.max_request_vectors

    def resolve_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.all_layers:
            return tuple(range(num_layers))
        return parse_layers(self.layers, "actbus.steer.layers", num_layers=num_layers)


def _live(raw: Any, where: str) -> dict[str, VectorSource | None]:
    """``live``: a list of names (each starts as zeros) or a mapping of names to their
    first values' source (null: zeros)."""
    if isinstance(raw, (list, tuple)):
        raw = dict.fromkeys(raw)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: expected a list of names such as ['probe_dir'] or a mapping of names "
            "to their first values ({'probe_dir': {'probe': DIR}}, or null for zeros)"
        )
    return {
        check_name(n, where): None if s is None else VectorSource.from_dict(s, f"{where}.{n}")
        for n, s in raw.items()
    }


def check_floats(raw: list | tuple | np.ndarray, where: str) -> np.ndarray:
    """A flat list of numbers finite as float32, as float32 (checked in one pass; the
    slow loop only runs to name the first bad component)."""
    try:
        arr = np.asarray(raw, dtype=np.float64)
        ok = arr.ndim == 1 and bool((np.abs(arr) <= FLOAT32_MAX).all())  # NaN: False
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        for j, x in enumerate(raw):
            check_finite(x, f"{where}[{j}]", "a vector component")
        raise ConfigError(f"{where}: expected a flat list of numbers")
    out = arr.astype(np.float32)
    out.setflags(write=False)
    return out


def parse_steer(
    raw: Any,
    where: str,
    *,
    num_layers: int | None = None,
    layers: tuple[int, ...] | None = None,
    hooks: tuple[str, ...] = STEER_HOOKS,
    width: int | None = None,
    max_len: int | None = None,
    ops: tuple[str, ...] | None = None,
) -> tuple[SteerSpec, ...]:
    """A list of steering entries, expanded to one ``SteerSpec`` per (layer, hook).

    With ``num_layers`` and ``layers``, each layer must exist and be steerable; with
    ``max_len`` (the model's ``max_model_len``), each listed position must be below it.
    Inline vectors are checked for finite values here and for width (``width``, the
    model's, when given) before they are converted. The (layer, hook) pairs the list
    expands to are counted first (``MAX_ENTRIES``), from the lists' lengths alone."""
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(
            f"{where}: expected a list of entries such as "
            "[{'vector': 'happy', 'layers': [3], 'scale': 4.0}], "
            f"got {type(raw).__name__}"
        )
    _check_count(raw, where, width)
    out: list[SteerSpec] = []
    starts: list[int] = []
    for i, e in enumerate(raw):
        starts.append(len(out))
        w = f"{where}[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{w}: expected a mapping with 'vector' and 'layers'")
        op = e.get("op", "add")
        if op not in OPS:
            raise ConfigError(f"{w}.op: expected one of {', '.join(OPS)}, got {op!r:.40}")
        if ops is not None and op not in ops:
            raise ConfigError(
                f"{w}.op: this engine does not {op}; list it in actbus.steer.ops "
                f"(it has {', '.join(ops)})"
            )
        keys = OP_KEYS[op]
        for k in e:
            if k not in keys:
                raise ConfigError(
                    f"{w}.{k}: unknown key for op {op!r}; valid keys are {', '.join(keys)}"
                )
        need = {"add": ("vector",), "ablate": ("directions",), "clamp": ("sae", "feature", "value")}
        for k in ("layers", *need.get(op, ())):
            if k not in e:
                raise ConfigError(f"{w}.{k}: required")
        ls = parse_layers(
            e["layers"], f"{w}.layers", num_layers=num_layers, steerable=layers, or_all=False
        )
        hs = parse_hooks(e.get("hooks", "post_block"), f"{w}.hooks", steerable=hooks)
        tier = e.get("tier", "base")
        if tier not in TIERS:
            raise ConfigError(f"{w}.tier: expected one of {', '.join(TIERS)}, got {tier!r:.40}")
        positions = parse_positions(e.get("positions", "all"), f"{w}.positions", max_len=max_len)
        if positions == "last":
            raise ConfigError(
                f"{w}.positions: 'last' is not known until a request ends; use 'generated', "
                "'last_prompt' or a list of positions"
            )
        if (tier, positions) in _EMPTY:
            raise ConfigError(
                f"{w}.positions: {positions!r} selects no token of tier {tier!r}; drop one of them"
            )
        gate = Gate.from_dict(e["gate"], f"{w}.gate") if e.get("gate") is not None else None
        points = [(layer, hook) for layer in ls for hook in hs]
        if op == "replace":
            out.extend(_replace_specs(e, w, points, tier, positions, gate, width))
            continue
        if op == "ablate":
            dirs = e["directions"]
            one = isinstance(dirs, str) or (
                isinstance(dirs, _SEQ) and len(dirs) and not isinstance(dirs[0], (*_SEQ, str))
            )
            dirs = [dirs] if one else dirs
            if not isinstance(dirs, _SEQ) or not 1 <= len(dirs) <= MAX_DIRECTIONS:
                raise ConfigError(
                    f"{w}.directions: expected a vector (a name or a list of floats) or a list "
                    f"of 1..{MAX_DIRECTIONS} of them"
                )
            got = tuple(_vector(d, f"{w}.directions[{j}]", width) for j, d in enumerate(dirs))
            out.extend(
                SteerSpec(la, h, "", 0.0, False, tier, positions, gate, "ablate", got)
                for la, h in points
            )
            continue
        if op == "clamp":
            sae = e["sae"]
            if not isinstance(sae, str) or not sae or len(sae) > 4096:
                raise ConfigError(
                    f"{w}.sae: expected an SAE checkpoint's directory, got {sae!r:.60}"
                )
            feature = e["feature"]
            if (
                not isinstance(feature, int)
                or isinstance(feature, bool)
                or not 0 <= feature < 2**31
            ):
                raise ConfigError(
                    f"{w}.feature: expected a latent index (an int32 >= 0), got {show_int(feature)}"
                )
            value = check_finite(e["value"], f"{w}.value", "a latent's value")
            out.extend(
                SteerSpec(
                    la, h, "", 0.0, False, tier, positions, gate, "clamp", (), sae, feature, value
                )
                for la, h in points
            )
            continue
        vec = _vector(e["vector"], f"{w}.vector", width)
        scale = check_finite(e.get("scale", 1.0), f"{w}.scale", "a scale")
        norm_match = e.get("norm_match", False)
        if not isinstance(norm_match, bool):
            raise ConfigError(f"{w}.norm_match: expected true or false, got {norm_match!r:.40}")
        out.extend(
            SteerSpec(la, h, vec, scale, norm_match, tier, positions, gate) for la, h in points
        )
    starts.append(len(out))
    return tuple(
        replace(s, entry=i) for i in range(len(raw)) for s in out[starts[i] : starts[i + 1]]
    )


def _vector(vec: Any, where: str, width: int | None = None) -> str | np.ndarray:
    """A registered vector's name, or inline values checked finite as float32 (and,
    with ``width``, as wide as the model's residual stream: the error names ``where``,
    the key the values came from)."""
    if isinstance(vec, str):
        return check_name(vec, where)
    if isinstance(vec, (list, tuple, np.ndarray)) and len(vec):
        if width is not None and len(vec) != width:
            raise ConfigError(
                f"{where}: has {len(vec)} values; this model's residual stream has {width}"
            )
        return check_floats(vec, where)
    raise ConfigError(
        f"{where}: expected a registered vector's name or a list of floats, got {vec!r:.60}"
    )


def _replace_specs(
    e: dict, w: str, points: list, tier: str, positions: Any, gate: Any, width: int | None
):
    """A ``replace`` entry's specs: one row for every selected token (``vector``), or
    ``rows[j]`` at ``positions[j]`` (each its own spec, listed at that position)."""
    if ("vector" in e) == ("rows" in e):
        raise ConfigError(
            f"{w}: give exactly one of 'vector' (one row for every selected token) or 'rows' "
            "(one row per listed position)"
        )
    if "vector" in e:
        vec = _vector(e["vector"], f"{w}.vector", width)
        return [
            SteerSpec(la, h, vec, 1.0, False, tier, positions, gate, "replace") for la, h in points
        ]
    rows, raw_pos = e["rows"], e.get("positions")
    if not isinstance(rows, (list, tuple, np.ndarray)) or not len(rows):
        raise ConfigError(f"{w}.rows: expected a non-empty list of rows (lists of floats)")
    if not isinstance(raw_pos, (list, tuple)) or len(raw_pos) != len(rows):
        raise ConfigError(
            f"{w}.positions: 'rows' needs a list of positions of the same length "
            f"({len(rows)}), rows[j] replacing the stream at positions[j]"
        )
    if len(positions) != len(raw_pos):
        raise ConfigError(f"{w}.positions: a position is listed twice")
    got = [_vector(r, f"{w}.rows[{j}]", width) for j, r in enumerate(rows)]
    return [
        SteerSpec(la, h, v, 1.0, False, tier, (int(p),), gate, "replace", key=f"rows[{j}]")
        for la, h in points
        for j, (v, p) in enumerate(zip(got, raw_pos, strict=True))
    ]


def _length(v: Any) -> int:
    """Items a ``layers``/``hooks`` value names (one for a scalar)."""
    return len(v) if isinstance(v, (list, tuple)) else 1


_SEQ = (list, tuple, np.ndarray)


def _check_count(raw: list | tuple, where: str, width: int | None) -> None:
    """Refuse, before any entry is read or expanded, a list that expands past
    ``MAX_ENTRIES`` (layers x hooks per entry, at most), lists longer than
    ``MAX_LIST`` and inline vectors wider than the model: a hostile request costs a few
    length checks per entry."""
    if len(raw) > MAX_ENTRIES:
        raise ConfigError(
            f"{where}: {len(raw)} entries; at most {MAX_ENTRIES} (layer, hook) entries per request"
        )
    total = rows_total = 0
    limit = width if width is not None else MAX_VECTOR_WIDTH
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            continue  # named below
        for k in ("layers", "hooks", "positions"):
            if _length(e.get(k)) > MAX_LIST:
                raise ConfigError(f"{where}[{i}].{k}: {_length(e[k])} items; at most {MAX_LIST}")
        rows, dirs = e.get("rows"), e.get("directions")
        many = {"rows": rows, "directions": dirs}
        for k, items in many.items():
            if isinstance(items, _SEQ) and len(items) and isinstance(items[0], _SEQ):
                cap = MAX_ROWS if k == "rows" else MAX_DIRECTIONS
                if len(items) > cap:
                    raise ConfigError(f"{where}[{i}].{k}: {len(items)} items; at most {cap}")
                for j, r in enumerate(items):
                    if isinstance(r, _SEQ) and len(r) > limit:
                        raise ConfigError(
                            f"{where}[{i}].{k}[{j}]: has {len(r)} values; at most {limit}"
                        )
        flat = isinstance(dirs, (list, tuple)) and dirs and not isinstance(dirs[0], _SEQ)
        if flat and len(dirs) > limit:
            raise ConfigError(f"{where}[{i}].directions: has {len(dirs)} values; at most {limit}")
        vec = e.get("vector")
        if isinstance(vec, (list, tuple)) and len(vec) > limit:
            raise ConfigError(
                f"{where}[{i}].vector: has {len(vec)} values; "
                + (
                    f"this model's residual stream has {width}"
                    if width is not None
                    else f"at most {MAX_VECTOR_WIDTH}"
                )
            )
        layers = e.get("layers")
        n_layers = (
            len(set(layers)) if isinstance(layers, (list, tuple)) and _hashable(layers) else 1
        )
        hooks = e.get("hooks", "post_block")
        n_hooks = len(set(hooks)) if isinstance(hooks, (list, tuple)) and _hashable(hooks) else 1
        if isinstance(rows, _SEQ):
            rows_total += len(rows) * n_layers * n_hooks
            if rows_total > MAX_ROWS:
                raise ConfigError(
                    f"{where}: more than {MAX_ROWS} replaced rows once layers and hooks are "
                    f"expanded (entry {i} reaches {rows_total}); at most {MAX_ROWS} per request"
                )
            continue  # counted as rows, not entries
        total += n_layers * n_hooks
        if total > MAX_ENTRIES:
            raise ConfigError(
                f"{where}: more than {MAX_ENTRIES} (layer, hook) entries once layers and hooks "
                f"are expanded (entry {i} reaches {total}); at most {MAX_ENTRIES} per request"
            )


def _hashable(items: list | tuple) -> bool:
    return all(isinstance(x, (int, str)) for x in items)
