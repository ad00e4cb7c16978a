"""Configurations of the trainers: what to train, on what, from where.

Plain dataclasses, checked when built, so a bad value fails before any data
flows, with an error naming the field and the fix. ``actbus run sae|probe`` makes its
flags from these fields (``actbus.flags``): a field's docstring is its help, and
``metadata=flag(...)`` says what its type cannot (choices, a list of values to sweep).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from actbus.flags import flag
from actbus.streams import point_key

SAE_KINDS = ("topk", "batchtopk", "relu", "jumprelu")
K_KINDS = ("topk", "batchtopk")
"""The kinds ``k`` (active latents per token) means something for."""
PROBE_KINDS = ("logistic", "linear")
B_DEC_INITS = ("geometric_median", "mean", "zeros")
DECODERS = ("sparse", "dense")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class SAEConfig:
    """One sparse autoencoder on one (layer, hook) stream."""

    d_in: int
    kind: str = field(default="topk", metadata=flag(choices=SAE_KINDS))
    """Activation: topk, batchtopk, relu (L1 penalty) or jumprelu (L0 penalty)."""
    expansion: int = field(default=16, metadata=flag(sweep=True))
    """Latents per input dimension (d_sae / d_in)."""
    d_sae: int | None = None
    """Latents; default ``d_in * expansion``."""
    k: int = field(default=32, metadata=flag(sweep=True))
    """Active latents per token (topk), or on average per token (batchtopk)."""
    aux_k: int | None = None
    """Dead latents used by the AuxK loss (topk, batchtopk); default ``d_in // 2``; 0: off."""
    aux_coeff: float = 1 / 32
    """Weight of the AuxK loss."""
    dead_tokens: int = 10_000_000
    """A latent that fired on none of the last this many tokens is dead."""
    l1_coeff: float = 0.2
    """relu: weight of the L1 penalty (per token, over sqrt(d_in), on normalised inputs)."""
    l0_coeff: float = 0.01
    """jumprelu: weight of the L0 penalty (active latents per token)."""
    jumprelu_init_threshold: float = 0.5
    """jumprelu: initial threshold, on normalised inputs (about unit scale per dimension)."""
    jumprelu_bandwidth: float = 0.1
    """jumprelu: width of the rectangle kernel that gives the threshold its gradient."""
    lr: float = 2e-4
    """Learning rate (Adam)."""
    b_dec_init: str = field(default="geometric_median", metadata=flag(choices=B_DEC_INITS))
    """Initial decoder bias, from the first batch: its geometric median, its mean, or zeros."""
    normalize: bool = True
    """Scale inputs by one scalar so their mean squared norm is ``d_in`` (kept with the model)."""
    decoder: str = field(default="sparse", metadata=flag(choices=DECODERS))
    """topk/batchtopk: ``sparse`` decodes with a gather (embedding_bag), ``dense`` with a matmul."""
    layer: int = 0
    hook: str = "post_block"
    name: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.kind in SAE_KINDS, f"kind: {self.kind!r} is unknown; choose {SAE_KINDS}")
        _check(self.d_in > 0, f"d_in: expected > 0, got {self.d_in}")
        if self.d_sae is None:
            _check(self.expansion > 0, f"expansion: expected > 0, got {self.expansion}")
            self.d_sae = self.d_in * self.expansion
        _check(self.d_sae > 0, f"d_sae: expected > 0, got {self.d_sae}")
        if self.kind in K_KINDS:
            _check(0 < self.k <= self.d_sae, f"k: expected 1..d_sae ({self.d_sae}), got {self.k}")
            if self.aux_k is None:
                self.aux_k = self.d_in // 2
            _check(self.aux_k >= 0, f"aux_k: expected >= 0, got {self.aux_k}")
        else:
            self.aux_k = 0
        _check(self.lr > 0, f"lr: expected > 0, got {self.lr}")
        _check(self.dead_tokens > 0, f"dead_tokens: expected > 0, got {self.dead_tokens}")
        _check(
            self.b_dec_init in B_DEC_INITS,
            f"b_dec_init: {self.b_dec_init!r} is unknown; choose {B_DEC_INITS}",
        )
        _check(
            self.decoder in DECODERS,
            f"decoder: expected sparse or dense, got {self.decoder!r}",
        )
        _check(self.layer >= 0, f"layer: expected >= 0, got {self.layer}")
        if not self.name:
            x = self.d_sae // self.d_in
            k = f"-k{self.k}" if self.kind in K_KINDS else ""  # relu, jumprelu: no k
            self.name = f"{point_key(self.layer, self.hook)}-{self.kind}{k}-x{x}"

    @property
    def stream(self) -> str:
        return point_key(self.layer, self.hook)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SAEConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class ProbeConfig:
    """Linear probes (one head per label tag) on one (layer, hook) stream."""

    d_in: int
    labels: tuple[str, ...] = field(default=("label",), metadata=flag("--label"))
    """Request tags holding the targets, one head each."""
    kind: str = field(default="logistic", metadata=flag(choices=PROBE_KINDS))
    """logistic: a classifier per label (0/1 or booleans); linear: a regression."""
    lr: float = 1e-2
    """Learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    heldout: float = 0.2
    """Fraction of requests (by a hash of the request id) kept out of training."""
    normalize: bool = True
    """Standardise each input feature by its mean and std in the first batch."""
    layer: int = 0
    hook: str = "post_block"
    name: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.kind in PROBE_KINDS, f"kind: {self.kind!r} is unknown; choose {PROBE_KINDS}")
        _check(self.d_in > 0, f"d_in: expected > 0, got {self.d_in}")
        self.labels = tuple(self.labels)
        _check(len(self.labels) > 0, "labels: name at least one request tag (--label TAG)")
        _check(0.0 < self.heldout < 1.0, f"heldout: expected in (0, 1), got {self.heldout}")
        _check(self.lr > 0, f"lr: expected > 0, got {self.lr}")
        if not self.name:
            self.name = f"{point_key(self.layer, self.hook)}-probe-{self.kind}"

    @property
    def stream(self) -> str:
        return point_key(self.layer, self.hook)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class DataConfig:
    """Where tokens come from and how they are shuffled into batches.

    Exactly one of ``address`` (a live publisher) and ``run_dir`` (a run the sink
    wrote) is set; everything else applies to both.
    """

    streams: tuple[tuple[int, str], ...]
    address: str | None = None
    run_dir: str | None = None
    batch_tokens: int = 4096
    """Tokens per training batch."""
    buffer_tokens: int = 262_144
    """Shuffle buffer per stream, in tokens: batches are drawn at random from it."""
    warmup_tokens: int = 65_536
    """Tokens buffered per stream before the first batch (so early batches are mixed)."""
    max_tokens: int | None = None
    """Stop after this many tokens per stream were handed out (None: until the stream ends)."""
    epochs: int | None = None
    """--from: passes over the stored run (None: as many as make about 200 training steps,
    at most 1000, said at the start)."""
    idle_s: float | None = None
    """Live: stop when nothing arrived for this long (None: wait for the publisher's end)."""
    policy: str = "drop_oldest"
    window: int = 64
    window_mb: float = 128.0
    group: str = ""
    """Load-balancing group; set automatically per trainer when several ranks run (DDP)."""
    match: dict[str, Any] | None = None
    """Keep only requests whose tags match this filter (cut out at the publisher; from a
    stored run, by the same rule on the stored tags)."""
    label_tags: tuple[str, ...] = ()
    """Request tags read into a per-row ``label`` tensor (NaN where missing)."""
    labelled_only: bool = False
    """Keep only rows whose request carries every label tag (probes)."""
    labels_file: str | None = None
    """Stored runs: a JSON map request_id -> {tag: value}, as the bus would carry."""
    seed: int = 0
    """Seed of the shuffle (the command seeds the models with it too)."""
    prefetch: int = 2
    """Batches drawn ahead of the trainer on a thread of their own (pinned where CUDA is
    available, so the copy to the GPU is asynchronous); 0 draws them in the loop."""
    name: str = "trainer"
    server_key: str | None = None
    client_secret_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.streams = tuple((int(layer), str(hook)) for layer, hook in self.streams)
        _check(len(self.streams) > 0, "streams: name at least one (layer, hook)")
        _check(
            (self.address is None) != (self.run_dir is None),
            "give exactly one source: --connect ADDR (live) or --from DIR (a stored run)",
        )
        _check(self.batch_tokens > 0, f"batch_tokens: expected > 0, got {self.batch_tokens}")
        _check(
            self.epochs is None or self.epochs >= 1,
            f"epochs: expected at least 1 pass, got {self.epochs}",
        )
        _check(
            self.epochs is None or self.run_dir is not None,
            "epochs: passes over a stored run; give it with --from DIR (live, training ends "
            "with the stream: --max-tokens, --idle-s or the publisher's end)",
        )
        _check(self.prefetch >= 0, f"prefetch: expected >= 0 batches, got {self.prefetch}")
        _check(
            self.buffer_tokens >= 2 * self.batch_tokens,
            f"buffer_tokens: expected >= 2 x batch_tokens ({2 * self.batch_tokens}), "
            f"got {self.buffer_tokens}",
        )
        _check(
            0 <= self.warmup_tokens <= self.buffer_tokens,
            f"warmup_tokens: expected 0..buffer_tokens ({self.buffer_tokens}), "
            f"got {self.warmup_tokens}",
        )
        self.label_tags = tuple(self.label_tags)
