"""Storage reductions: what the sink writes in place of the captured rows.

=========  ==============================  ======================  =====================
``--reduce``  stored columns                 decoded as              error
=========  ==============================  ======================  =====================
none       activation [hidden] as captured  captured dtype, exact   none
fp16/bf16  activation [hidden] cast         float16 / bfloat16      the cast's rounding
int8       activation int8 [hidden],        float32 ``q * scale``   ``|x - x̂| <= scale/2``
           scale float32 (absmax/127)                               per element
proj:K     activation float32 [K] = x @ R   the K-dim projection    JL: norms and inner
           (R: N(0, 1/K), seed stored)      (reduced space)         products kept ~1/sqrt(K)
pca:K      activation float32 [K] coeffs    float32 [hidden]        what the K components
           (basis fitted on the first        reconstruction          miss (reported as
           --pca-warmup rows, stored with    ``c @ B + mean``        relative L2 error)
           the run as safetensors)
topk:K     activation [K] values as         captured dtype [hidden]  the dropped entries;
           captured, topk_index [K]         dense, zeros elsewhere  kept ones exact
=========  ==============================  ======================  =====================

Everything a reader needs is in each shard's schema metadata (``actbus.reduction``),
plus, for PCA, the basis file the manifest names with its checksum.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file

from consumers.fs import layout

KINDS = ("none", "fp16", "bf16", "int8", "proj", "pca", "topk")
_CAST = {"fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Reduction:
    """One storage reduction; ``k`` for proj/pca/topk, ``seed`` for proj,
    ``warmup`` (rows) for pca."""

    kind: str = "none"
    k: int = 0
    seed: int = 0
    warmup: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--reduce: unknown kind {self.kind!r}; expected one of {KINDS}")
        if self.kind in ("proj", "pca", "topk") and self.k < 1:
            raise ValueError(f"--reduce {self.kind}:K needs K >= 1, got {self.k}")
        if self.kind == "pca" and self.warmup < self.k:
            raise ValueError(
                f"--pca-warmup {self.warmup} is below K={self.k}: a basis of K components "
                "needs at least K rows"
            )

    @property
    def lossless(self) -> bool:
        return self.kind == "none"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Reduction:
        return cls(**d)

    def stored_dtype(self, captured: str) -> str:
        """The dtype of the activation column's values."""
        if self.kind in _CAST:
            return _CAST[self.kind]
        if self.kind == "int8":
            return "int8"
        if self.kind in ("proj", "pca"):
            return "float32"
        return captured

    def width(self, hidden: int) -> int:
        """Values per row in the activation column."""
        if self.kind == "topk" and self.k > hidden:
            raise ValueError(f"--reduce topk:{self.k}: K is above the hidden size {hidden}")
        if self.kind == "proj" and self.k > hidden:
            raise ValueError(f"--reduce proj:{self.k}: K is above the hidden size {hidden}")
        if self.kind == "pca" and self.k > hidden:
            raise ValueError(f"--reduce pca:{self.k}: K is above the hidden size {hidden}")
        return self.k if self.kind in ("proj", "pca", "topk") else hidden

    def decoded_width(self, hidden: int) -> int:
        return self.k if self.kind == "proj" else hidden


def parse_reduction(text: str, *, seed: int = 0, warmup: int = 4096) -> Reduction:
    """``none``, ``fp16``, ``bf16``, ``int8``, ``proj:K``, ``pca:K`` or ``topk:K``."""
    kind, _, k = text.partition(":")
    if kind in ("proj", "pca", "topk"):
        if not k.isdigit():
            raise ValueError(f"--reduce {text!r}: {kind} needs a size, e.g. {kind}:64")
        return Reduction(kind, int(k), seed=seed, warmup=warmup)
    if k:
        raise ValueError(f"--reduce {text!r}: {kind} takes no size")
    return Reduction(kind, seed=seed, warmup=warmup)


def projection_matrix(hidden: int, k: int, seed: int) -> torch.Tensor:
    """The ``[hidden, k]`` random projection of ``proj:K`` (N(0, 1/k) entries),
    rebuilt bit for bit from the stored seed on any machine (CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hidden, k, generator=g, dtype=torch.float32) / k**0.5


def fit_pca(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [hidden], basis [k, hidden])``: the top-k principal directions."""
    x = x.float()
    mean = x.mean(0)
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
    basis = vh[:k].contiguous()
    if basis.shape[0] < k:  # fewer rows than k: pad with zero directions
        basis = torch.cat([basis, torch.zeros(k - basis.shape[0], x.shape[1])])
    return mean.contiguous(), basis


def save_basis(path: Path, mean: torch.Tensor, basis: torch.Tensor) -> None:
    """Durably (tmp, fsync, rename): shards that use it are written after it."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({"mean": mean, "basis": basis}, str(tmp))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(path)
    layout.fsync_dir(path.parent)


def load_basis(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    d = load_file(str(path))
    return d["mean"], d["basis"]


class Encoder:
    """Turns captured rows into the reduction's columns for one (layer, hook)."""

    def __init__(
        self,
        spec: Reduction,
        dtype: str,
        hidden: int,
        basis: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.hidden = hidden
        self.width = spec.width(hidden)
        self.stored = spec.stored_dtype(dtype)
        self._proj = projection_matrix(hidden, spec.k, spec.seed) if spec.kind == "proj" else None
        self.basis = basis

    @property
    def ready(self) -> bool:
        """False for PCA until its basis is fitted."""
        return self.spec.kind != "pca" or self.basis is not None

    def fields(self, basis_file: str = "") -> list[pa.Field]:
        meta = {"actbus.reduction": json.dumps(self.spec.to_json())}
        if basis_file:
            meta["actbus.basis"] = basis_file
        out = [layout.vector_field("activation", self.stored, self.width, **meta)]
        if self.spec.kind == "int8":
            out.append(pa.field("scale", pa.float32()))
        if self.spec.kind == "topk":
            out.append(layout.vector_field("topk_index", self._index_dtype(), self.width))
        return out

    def _index_dtype(self) -> str:
        return "uint16" if self.hidden < (1 << 16) else "int32"

    def encode(self, t: torch.Tensor) -> list[pa.Array]:
        kind = self.spec.kind
        if kind == "none":
            return [layout.tensor_to_arrow(t)]
        if kind in _CAST:
            return [layout.tensor_to_arrow(t.to(layout.TORCH[_CAST[kind]]))]
        if kind == "int8":
            x = t.float()
            scale = x.abs().amax(dim=1) / 127.0
            q = torch.round(x / scale.clamp_min(1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
            return [layout.tensor_to_arrow(q), pa.array(scale.numpy())]
        if kind == "proj":
            return [layout.tensor_to_arrow(t.float() @ self._proj)]
        if kind == "pca":
            mean, basis = self.basis
            return [layout.tensor_to_arrow((t.float() - mean) @ basis.T)]
        # topk: the K largest magnitudes, indices ascending so rows compress better
        idx = t.float().abs().topk(self.width, dim=1).indices.sort(dim=1).values
        vals = t.gather(1, idx)
        if self._index_dtype() == "uint16":
            idx_t = idx.to(torch.int32).numpy().astype("uint16")
            index = pa.FixedSizeListArray.from_arrays(pa.array(idx_t.reshape(-1)), self.width)
        else:
            index = layout.tensor_to_arrow(idx.to(torch.int32))
        return [layout.tensor_to_arrow(vals), index]


class Decoder:
    """Decodes the activation columns of one run's shards (any reduction)."""

    def __init__(self, run: Path) -> None:
        self.run = Path(run)
        self._bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._proj: dict[tuple[int, int, int], torch.Tensor] = {}

    def decode(
        self, batch: pa.RecordBatch | pa.Table, hidden: int, basis: str | None = None
    ) -> torch.Tensor:
        """``[rows, width]``: see the module table for what each reduction gives.
        ``basis``: the PCA basis file of these rows, in place of the one the schema
        names (a table of several layers/hooks carries only its first shard's)."""
        field = batch.schema.field("activation")
        meta = {k.decode(): v.decode() for k, v in (field.metadata or {}).items()}
        stored = meta.get("actbus.dtype", "float32")
        spec = Reduction.from_json(json.loads(meta.get("actbus.reduction", '{"kind": "none"}')))
        values = layout.arrow_to_tensor(batch.column("activation"), stored)
        kind = spec.kind
        if kind in ("none", "fp16", "bf16", "proj"):
            return values
        if kind == "int8":
            scale = torch.from_numpy(np.require(batch.column("scale").to_numpy(), requirements="W"))
            return values.float() * scale[:, None]
        if kind == "pca":
            mean, b = self._basis(basis or meta["actbus.basis"])
            return values @ b + mean
        index = layout.arrow_to_tensor(batch.column("topk_index"), "int32")
        dense = torch.zeros(values.shape[0], hidden, dtype=values.dtype)
        return dense.scatter_(1, index.long(), values)

    def _basis(self, rel: str) -> tuple[torch.Tensor, torch.Tensor]:
        if rel not in self._bases:
            self._bases[rel] = load_basis(self.run / rel)
        return self._bases[rel]
