"""Front-end side of steering: a request's steering resolved into what the worker trusts.

A request's own entries (``extra_args["actbus"]["steer"]``) are checked against the
model and the engine's steerable points, names are resolved to values in the
registry, and the engine's global entries are added unless the request opts out
(``"steer_global": false``). The result goes to the worker with the request, vectors
and all, so the worker never looks a name up: a vector replaced while serving changes
requests admitted afterwards, and no request changes vector mid-way.

A name of the engine's live vectors (``actbus.steer.live``) is not resolved here: the
worker resolves it when it admits the request, to the version in use then
(``actbus.steer.live``).

Steering changes the KV cache of the positions it steers and of every one after
them, so a steered request gets a salt for the blocks from its first steered position
on (``RequestSteer.kv_salt``, ``actbus.engine.kvsalt``), derived from that steering:
same steering at the same positions, shared blocks; different or none, separate. The
blocks before (a decode-only request's prompt) keep their plain hashes and stay shared.
The version of a live vector is unknown here, so steering with one gets a salt of its
own: such a request shares its steered blocks with no other. A gated entry's gate is
part of that steering (its monitor, column, threshold, sharpness and source), so gated
steering shares its steered blocks only with the same gate.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actbus.checkpoints import SAE_WEIGHTS, Confine, SAEFeature, read_sae_feature
from actbus.errors import ConfigError
from actbus.fields import FLOAT32_MAX
from actbus.steer.config import SteerConfig, SteerSpec, monitor_runs_before, parse_steer
from actbus.steer.live import LIVE_PREFIX
from actbus.steer.vectors import Vector, VectorRegistry

if TYPE_CHECKING:
    from actbus.monitor.config import MonitorConfig

GLOBAL_WHERE = "actbus.steer.global"
SAE_CACHE = 256
"""SAE latents the front end keeps read (clamp), the oldest dropped first."""


@dataclass(frozen=True, eq=False)
class Resolved:
    """One spec with its vector's values (None for a live vector, resolved in the
    worker) and its coefficients ``(a, b)``."""

    spec: SteerSpec
    vector: Vector | None
    gate: tuple | None = None
    """The gate as the worker reads it: (monitor, layer, hook, feature or -1, threshold,
    sharpness or 0.0 for a hard gate, source)."""
    live: str | None = None
    """The live vector's name, when ``spec.vector`` names one."""
    read: Vector | None = None
    """What ``ablate`` and ``clamp`` project the stream on (the direction; the SAE
    latent's encoder column), paired with ``vector`` in one row of the device tables."""
    terms: tuple[float, ...] = ()
    """The other operations' coefficients ``(c, e, d, t, z)`` (``actbus.steer.graph``);
    empty for ``add``."""

    @property
    def coef(self) -> tuple[float, float]:
        """A live vector's norm-matching ``b`` is its scale: the worker divides it by
        the norm of the version it resolves."""
        s = self.spec
        if s.op == "replace":
            return (1.0, 0.0)
        if s.op != "add":
            return (s.value, 0.0)  # clamp: the latent's value; ablate: 0
        if not s.norm_match:
            return (s.scale, 0.0)
        return (0.0, s.scale if self.vector is None else s.scale / self.vector.norm)

    @property
    def vector_key(self) -> str:
        if self.vector is None:
            return LIVE_PREFIX + str(self.live)
        return self.vector.digest + ("" if self.read is None else "|" + self.read.digest)

    def key(self) -> list[Any]:
        s = self.spec
        pos = s.positions if isinstance(s.positions, str) else list(s.positions)
        key = [s.layer, s.hook, self.vector_key, *self.coef, s.tier, pos]
        if self.terms:  # the wire's 9th item; an add's key stays as it always was
            return [*key, None if self.gate is None else list(self.gate), list(self.terms)]
        return key if self.gate is None else [*key, list(self.gate)]

    def first_steered(self, prompt_len: int) -> int | None:
        """The first position whose stream this entry may change (None: none), from its
        tier and positions; a gate may keep it shut, but may open it."""
        s = self.spec
        lo, hi = 0, None
        if s.tier == "decode" or s.positions == "generated":
            lo = prompt_len
        if s.tier == "prefill" or s.positions == "prompt":
            hi = prompt_len
        if s.positions == "last_prompt":
            lo, hi = max(lo, prompt_len - 1), prompt_len
        if isinstance(s.positions, tuple):
            listed = [p for p in s.positions if p >= lo and (hi is None or p < hi)]
            return min(listed) if listed else None
        return lo if hi is None or lo < hi else None

    @property
    def by_prompt(self) -> bool:
        """Whether the positions it steers depend on the prompt's length."""
        return self.spec.tier != "base" or self.spec.positions in (
            "prompt",
            "generated",
            "last_prompt",
        )


@dataclass(frozen=True, eq=False)
class RequestSteer:
    """A request's whole steering (global and own)."""

    entries: tuple[Resolved, ...]

    def to_wire(self) -> dict[str, Any]:
        vectors = {  # a paired row: the written vector's values, then the read one's
            r.vector_key: r.vector.values.tobytes()
            + (b"" if r.read is None else r.read.values.tobytes())
            for r in self.entries
            if r.vector is not None
        }
        return {"vectors": vectors, "entries": [r.key() for r in self.entries]}

    def kv_salt(self, prompt_len: int) -> tuple[int, str] | None:
        """The first position whose KV this steering may change, and a digest of the
        steering as a function of position (``actbus.engine.kvsalt`` salts the blocks
        from there on); None if it changes none. Same steering at the same positions,
        same salt: such requests share their steered blocks too. Steering with a live
        vector (its version is chosen in the worker) makes the salt this request's own."""
        firsts = [(r.first_steered(prompt_len), r) for r in self.entries]
        touching = [r for first, r in firsts if first is not None]
        if not touching:
            return None
        keys = sorted(json.dumps(r.key()) for r in touching)
        if any(r.by_prompt for r in touching):  # its positions are the prompt's own
            keys.append(f"prompt_len={prompt_len}")
        if any(r.live is not None for r in touching):
            keys.append(secrets.token_hex(16))
        digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:32]
        return min(f for f, _ in firsts if f is not None), "actbus-steer:" + digest


class SteerFrontend:
    """The engine's steering as the front end sees it: steerable points, the named
    vectors and the global entries. Changes while serving apply to new requests."""

    def __init__(
        self,
        cfg: SteerConfig,
        *,
        num_layers: int,
        hidden_size: int,
        monitors: MonitorConfig | None = None,
        stages: tuple[int, ...] | None = None,
        max_len: int | None = None,
        max_rows: int | None = None,
    ) -> None:
        """``max_len``: the model's ``max_model_len``, which listed positions must be below;
        ``max_rows``: distinct vectors one request may hold (``SteerConfig.request_rows``;
        None: no bound, for front ends that never reach an engine)."""
        self.cfg = cfg
        self.max_len = max_len
        self.max_rows = max_rows
        self.monitors = monitors
        self.stages = stages
        """Per layer, the pipeline stage that computes it (None: one stage)."""
        self.num_layers = num_layers
        self.layers = cfg.resolve_layers(num_layers)
        self.hooks = cfg.hooks
        self.registry = VectorRegistry(
            hidden_size, live=frozenset(cfg.live), max_named=cfg.max_named
        )
        self.confine = Confine(cfg.vector_dirs)
        """Where HTTP callers' path sources may be read from."""
        for name, src in cfg.vectors.items():
            self.registry.register(name, src, "actbus.steer.vectors")
        self._lock = threading.Lock()
        self._sae_cache: dict[tuple, SAEFeature] = {}
        self._global: tuple[Resolved, ...] = ()
        self.set_global(list(cfg.global_steer))

    def parse(self, raw: Any, where: str) -> tuple[SteerSpec, ...]:
        return parse_steer(
            raw,
            where,
            num_layers=self.num_layers,
            layers=self.layers,
            hooks=self.hooks,
            width=self.registry.width,
            max_len=self.max_len,
            ops=self.cfg.ops,
        )

    def resolve(
        self, specs: tuple[SteerSpec, ...], where: str, confine: Confine | None = None
    ) -> tuple[Resolved, ...]:
        """Names and files resolved to values; ``confine``: where a ``clamp``'s SAE may
        be read from (an HTTP caller's request), None for the operator's own entries."""
        out: list[Resolved] = []
        for i, s in enumerate(specs):
            at = f"{where}[{s.entry if s.entry >= 0 else i}]"  # the entry, not the spec
            gate = self._gate(s, f"{at}.gate") if s.gate is not None else None
            if s.op in ("ablate", "clamp"):
                out.extend(self._project(s, gate, at, confine))
                continue
            terms = (0.0, 0.0, 0.0, 0.0, 1.0) if s.op == "replace" else ()
            if isinstance(s.vector, str) and s.vector in self.cfg.live:
                out.append(Resolved(s, None, gate, live=s.vector, terms=terms))
                continue
            if isinstance(s.vector, str):
                vec = self.registry.get(s.vector, f"{at}.{s.key}")
            else:
                vec = Vector.of(s.vector, f"{at}.{s.key}", self.registry.width)
            if s.norm_match and vec.norm == 0.0:
                raise ConfigError(f"{at}.norm_match: the vector is zero; nothing to match")
            if s.norm_match and abs(s.scale / vec.norm) > FLOAT32_MAX:
                raise ConfigError(
                    f"{at}.scale: {s.scale:.4g} / the vector's norm {vec.norm:.4g} "
                    "is past float32's range; use a smaller scale or a larger vector"
                )
            out.append(Resolved(s, vec, gate, terms=terms))
        return tuple(out)

    def _project(
        self, s: SteerSpec, gate: tuple | None, where: str, confine: Confine | None
    ) -> list[Resolved]:
        """``ablate``: one entry per direction, orthonormalized (their projections then
        add up to the projection on their span); ``clamp``: the SAE latent's rows."""
        width = self.registry.width
        if s.op == "clamp":
            feat = self._sae_feature(s, f"{where}.sae", confine)
            dec = Vector.of(feat.decoder, f"{where}.sae", width)
            enc = Vector.of(feat.encoder, f"{where}.sae", width)
            return [
                Resolved(s, dec, gate, read=enc, terms=(0.0, -1.0, feat.bias, feat.threshold, 0.0))
            ]
        rows = []
        for j, d in enumerate(s.directions):
            w = f"{where}.directions[{j}]"
            if isinstance(d, str) and d in self.cfg.live:
                raise ConfigError(
                    f"{w}: {d!r} is a live vector; ablate directions are fixed when a request "
                    "is admitted: register the direction (or give its values)"
                )
            v = self.registry.get(d, w) if isinstance(d, str) else Vector.of(d, w, width)
            rows.append(v.values.astype(np.float64))
        q, r = np.linalg.qr(np.stack(rows, axis=1))  # [hidden, m]: an orthonormal basis
        diag = np.abs(np.diag(r))
        if not (diag > 1e-6 * max(1.0, float(diag.max(initial=0.0)))).all():
            raise ConfigError(
                f"{where}.directions: the directions are zero or linearly dependent; give "
                "independent ones"
            )
        out = []
        for j in range(q.shape[1]):
            u = Vector.of(q[:, j].astype(np.float32), f"{where}.directions[{j}]", width)
            out.append(Resolved(s, u, gate, read=u, terms=(-1.0, 0.0, 0.0, 0.0, 0.0)))
        return out

    def _sae_feature(self, s: SteerSpec, where: str, confine: Confine | None) -> SAEFeature:
        """The latent an SAE directory holds, cached by file identity (a checkpoint
        rewritten in place is read again)."""
        path = Path(s.sae) if confine is not None else Path(s.sae).expanduser()
        if confine is not None:
            confine(path, where)
        try:
            st = (path / SAE_WEIGHTS).stat()
            ident = (os.path.realpath(path), st.st_mtime_ns, st.st_size, s.feature)
        except OSError:
            ident = None
        with self._lock:
            got = self._sae_cache.get(ident) if ident is not None else None
        if got is None:
            got = read_sae_feature(path, s.feature, where, confine)
            with self._lock:
                if ident is not None:
                    self._sae_cache[ident] = got
                    while len(self._sae_cache) > SAE_CACHE:
                        self._sae_cache.pop(next(iter(self._sae_cache)))
        return got

    def _gate(self, s: SteerSpec, where: str) -> tuple:
        """A gate checked against the engine's monitors, in the worker's form."""
        g = s.gate
        assert g is not None
        mons = self.monitors.monitors if self.monitors is not None else {}
        d = mons.get(g.monitor)
        if d is None:
            known = ", ".join(sorted(mons)[:20]) or "none configured"
            raise ConfigError(
                f"{where}.monitor: no monitor named {g.monitor!r:.60} on this engine (known: "
                f"{known}); a gate reads a monitor of the engine's actbus.monitor.monitors"
            )
        layer = g.layer
        if layer is None:
            if len(d.layers) > 1:
                raise ConfigError(
                    f"{where}.layer: required: monitor {g.monitor!r} is evaluated at layers "
                    f"{list(d.layers)}; say which one's score gates"
                )
            layer = d.layers[0]
        elif layer not in d.layers:
            raise ConfigError(
                f"{where}.layer: monitor {g.monitor!r} is not evaluated at layer {layer} "
                f"(its layers: {list(d.layers)})"
            )
        feature = -1
        if d.kind == "sae":
            if g.feature is None or g.feature not in d.features:
                raise ConfigError(
                    f"{where}.feature: monitor {g.monitor!r} scores several SAE latents; give "
                    f"the one that gates, one of its features {list(d.features)[:20]}"
                    + ("" if g.feature is None else f" (got {g.feature})")
                )
            feature = g.feature
        elif g.feature is not None:
            raise ConfigError(
                f"{where}.feature: monitor {g.monitor!r} is a {d.kind} monitor with one score; "
                "drop 'feature'"
            )
        if g.source == "token" and not monitor_runs_before((layer, d.hook), s.point):
            raise ConfigError(
                f"{where}.source: 'token' reads this token's score, but monitor {g.monitor!r} "
                f"at layer {layer} {d.hook} is scored after the steered point (layer {s.layer} "
                f"{s.hook}); gate with a monitor at an earlier point, or use source 'previous'"
            )
        if self.stages is not None and self.stages[layer] != self.stages[s.layer]:
            raise ConfigError(
                f"{where}.layer: monitor {g.monitor!r} at layer {layer} is scored on pipeline "
                f"stage {self.stages[layer]}, but the steered layer {s.layer} runs on stage "
                f"{self.stages[s.layer]}, which never sees that score; under pipeline "
                "parallelism a gate reads a monitor on its own stage (stage of each layer: "
                f"{list(self.stages)})"
            )
        sharp = 0.0 if g.sharpness is None else g.sharpness
        return (g.monitor, layer, d.hook, feature, g.threshold, sharp, g.source)

    def set_global(self, raw: list[dict[str, Any]], *, trusted: bool = True) -> None:
        """Replace the global entries (checked, names resolved now). ``trusted``: the
        engine's config or an in-process caller; an HTTP caller's (``trusted=False``)
        ``clamp`` SAEs must lie in ``vector_dirs``."""
        confine = None if trusted else self.confine
        resolved = self.resolve(self.parse(raw, GLOBAL_WHERE), GLOBAL_WHERE, confine)
        self._check_per_token(resolved, GLOBAL_WHERE)
        self._check_rows(resolved, GLOBAL_WHERE)
        with self._lock:
            self._global = resolved

    @property
    def global_entries(self) -> tuple[Resolved, ...]:
        with self._lock:
            return self._global

    def request(
        self, raw: Any, use_global: Any, where: str, *, trusted: bool = False
    ) -> RequestSteer | None:
        """A request's steering: its own entries (``raw``, None if it has none) after
        the global ones unless ``use_global`` is false. ``trusted``: an in-process
        caller (``LLM``), whose SAE paths are not confined to ``vector_dirs``."""
        if not isinstance(use_global, bool):
            raise ConfigError(
                f"{where}_global: expected true or false (false: no global steering), "
                f"got {use_global!r:.40}"
            )
        confine = None if trusted else self.confine
        own = self.resolve(self.parse(raw, where), where, confine) if raw is not None else ()
        entries = (self.global_entries if use_global else ()) + own
        if not entries:
            return None
        self._check_per_token(entries, where)
        self._check_rows(entries, where)
        return RequestSteer(entries)

    def _check_rows(self, entries: tuple[Resolved, ...], where: str) -> None:
        """At most ``max_rows`` distinct vectors (rows of the engine's table): one request
        never fills the table its neighbours steer from."""
        n = len({r.vector_key for r in entries})
        if self.max_rows is not None and n > self.max_rows:
            raise ConfigError(
                f"{where}: {n} distinct vectors (replaced rows, directions, latents; global "
                f"entries included); one request may hold at most {self.max_rows} rows of the "
                "engine's steering table (actbus.steer.max_request_vectors)"
            )

    def _check_per_token(self, entries: tuple[Resolved, ...], where: str) -> None:
        """At most ``per_token`` slots per token at one point: entries on listed
        positions count at those positions (``replace``'s rows, one each)."""
        every = Counter(r.spec.point for r in entries if isinstance(r.spec.positions, str))
        listed = Counter(
            (r.spec.point, p)
            for r in entries
            if not isinstance(r.spec.positions, str)
            for p in r.spec.positions
        )
        counts = Counter(every)
        for (point, _p), n in listed.items():
            counts[point] = max(counts[point], every[point] + n)
        for (layer, hook), n in counts.items():
            if n > self.cfg.per_token:
                raise ConfigError(
                    f"{where}: {n} vectors at layer {layer} {hook} (global ones included); "
                    f"this engine adds at most {self.cfg.per_token} per token at one point "
                    "(actbus.steer.per_token)"
                )
