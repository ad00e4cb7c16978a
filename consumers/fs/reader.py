"""Reading a run the sink wrote: as a pyarrow dataset, or one request at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch

from consumers.fs import layout


class ActivationRun:
    """A run directory: its manifest and its committed shards."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest = layout.read_manifest(self.path)
        if manifest is None:
            raise FileNotFoundError(f"{self.path}: no {layout.MANIFEST}; is this an actbus run?")
        self.manifest: dict[str, Any] = manifest

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def shards(self, layer: int | None = None, hook: str | None = None) -> list[Path]:
        return [
            self.path / s["path"]
            for s in self.manifest["shards"]
            if (layer is None or s["layer"] == layer) and (hook is None or s["hook"] == hook)
        ]

    def dataset(self, layer: int | None = None, hook: str | None = None) -> ds.Dataset:
        """The committed shards (optionally of one layer/hook) as a pyarrow dataset."""
        return ds.dataset([str(p) for p in self.shards(layer, hook)], format="ipc")

    def request_rows(
        self, request_id: str, layer: int, hook: str = "post_block"
    ) -> tuple[np.ndarray, torch.Tensor]:
        """``(positions, activations)`` of one request, sorted by position.

        Positions are returned as stored, so callers can check for gaps or repeats.
        """
        table = self.dataset(layer, hook).to_table(
            columns=["position", "activation"], filter=pc.field("request_id") == request_id
        )
        if table.num_rows == 0:
            return np.zeros(0, dtype=np.int64), torch.zeros(0, self.hidden_size)
        table = table.sort_by("position")
        positions = table.column("position").to_numpy()
        return positions, layout.arrow_to_tensor(table.column("activation"), self.dtype)

    def request(self, request_id: str, layer: int, hook: str = "post_block") -> torch.Tensor:
        """One request's activations at ``layer``: ``[n_tokens, hidden]`` by position."""
        return self.request_rows(request_id, layer, hook)[1]

    def request_ids(self, layer: int | None = None, hook: str | None = None) -> list[str]:
        table = self.dataset(layer, hook).to_table(columns=["request_id"])
        return sorted(pc.unique(table.column("request_id")).to_pylist())
