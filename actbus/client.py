"""Returned activations and scores out of an OpenAI-server response, as tensors.

``returned(response)`` takes what a client got for a request that asked for rows
(``"return": true``) or scores (``"monitor_return": true``) and gives, per choice, the
rows keyed by ``(layer, hook)`` with their token positions. It reads:

- a whole response: the ``openai`` client's object, a ``dict`` of its JSON, or an
  ``httpx`` / ``requests`` response;
- a stream: the ``openai`` client's ``Stream`` (or a list of its chunks), an
  ``httpx`` / ``requests`` streamed response, or the SSE text itself; pieces are
  joined in order, each position once (``pieces`` gives each chunk's own: the rows
  of the tokens it carries).

Rows kept for fetching (``"return": "fetch"``) are read with ``fetch``. The format is
in docs/http.md; this module needs torch and numpy, not vLLM.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actbus.streams import parse_point_key

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""What a row may be, by the name the server writes."""


@dataclass
class Returned:
    """One choice's returned rows and scores, in position order."""

    positions: torch.Tensor
    """int64 ``[n]``: token positions of the rows (prompt first)."""
    token_ids: torch.Tensor
    """int64 ``[n]``: the token fed at each position."""
    tensors: dict[tuple[int, str], torch.Tensor]
    """``(layer, hook)`` -> ``[n, hidden]``, aligned with ``positions``."""
    complete: bool | None
    """The server had every row the tokens imply (None: the response had no final piece)."""
    scores: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    """``(monitor, layer)`` -> float32 ``[m, width]``, aligned with ``score_positions``."""
    score_positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    fetch: str | None = None
    """Where the rows wait to be fetched once (``"return": "fetch"``): read with ``fetch``."""
    late: int = 0
    """A streamed chunk's: rows of its tokens (and earlier chunks') that had not come in
    time; a later chunk of the choice carries them. Joined: the last piece's."""

    def __getitem__(self, key: tuple[int, str]) -> torch.Tensor:
        return self.tensors[key]


def decode_rows(entry: dict[str, Any]) -> tuple[tuple[int, str], torch.Tensor]:
    """One ``rows`` entry of ``choices[i].actbus.activations``: its stream and tensor."""
    dtype = DTYPES.get(entry.get("dtype"))
    shape = entry.get("shape")
    if dtype is None:
        raise ValueError(f"rows: unknown dtype {entry.get('dtype')!r:.40}")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape)):
        raise ValueError(f"rows: shape {shape!r:.40} is not [rows, hidden]")
    raw = base64.b64decode(entry["data"], validate=True)
    size = torch.empty(0, dtype=dtype).element_size()
    if len(raw) != shape[0] * shape[1] * size:
        raise ValueError(f"rows: {len(raw)} bytes do not make {shape} of {entry['dtype']}")
    if not raw:  # a streamed chunk with no new rows (a byte view of nothing has no stride)
        return (int(entry["layer"]), str(entry["hook"])), torch.empty(shape, dtype=dtype)
    data = np.frombuffer(raw, dtype="<u1").copy()  # little-endian bytes, owned
    t = torch.from_numpy(data).view(dtype).reshape(shape)
    return (int(entry["layer"]), str(entry["hook"])), t


def returned(response: Any) -> dict[int, Returned]:
    """Per choice index, what came back; choices that carried nothing are left out."""
    pieces: dict[int, list[dict[str, Any]]] = {}
    for choice in _choices(response):
        extra = choice.get("actbus")
        if isinstance(extra, dict):
            pieces.setdefault(int(choice.get("index", 0)), []).append(extra)
    return {i: _join(p) for i, p in sorted(pieces.items())}


def pieces(response: Any) -> Iterator[tuple[int, Returned]]:
    """(choice index, its piece) of each chunk of a stream (or of each choice of a whole
    response) that carried any, in order: a streamed chunk's rows are those of the
    tokens it carries (docs/http.md)."""
    for choice in _choices(response):
        extra = choice.get("actbus")
        if isinstance(extra, dict):
            yield int(choice.get("index", 0)), _join([extra])


def fetch(base_url: str, where: str, api_key: str | None = None, timeout: float = 60) -> Returned:
    """Rows kept for fetching: ``base_url`` the server (``http://host:8000``), ``where``
    the choice's ``fetch`` path (or the ``Returned`` that names it)."""
    from safetensors.torch import load

    path = where.fetch if isinstance(where, Returned) else where
    if not path:
        raise ValueError("fetch: this choice's rows were not kept for fetching")
    req = urllib.request.Request(base_url.rstrip("/") + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        blob = r.read()
    tensors = load(blob)
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])  # safetensors' own
    meta = header.get("__metadata__") or {}
    rows = {parse_point_key(k): t for k, t in tensors.items() if k.startswith("L")}
    return Returned(
        tensors["positions"], tensors["token_ids"], rows, meta.get("complete") == "true"
    )


# ----------------------------------------------------------------- reading responses
def _choices(response: Any) -> Iterator[dict[str, Any]]:
    for obj in _objects(response):
        yield from obj.get("choices") or ()


def _objects(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON objects of a response: itself, or each chunk of a stream."""
    if isinstance(response, dict):
        yield response
        return
    if hasattr(response, "model_dump"):  # an openai object: a response or one chunk
        yield response.model_dump()
        return
    if isinstance(response, (str, bytes)):
        yield from _sse(_lines(response))
        return
    headers = getattr(response, "headers", None)
    if headers is not None and hasattr(response, "iter_lines"):  # httpx, requests
        if "text/event-stream" in headers.get("content-type", ""):
            yield from _sse(response.iter_lines())
        else:
            yield response.json()
        return
    if isinstance(response, Iterable):  # a stream's chunks, or its lines
        for item in response:
            if isinstance(item, (str, bytes)):
                yield from _sse(_lines(item))
            else:
                yield from _objects(item)
        return
    raise TypeError(f"returned: cannot read a {type(response).__name__}")


def _lines(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode()
    return text.splitlines()


def _sse(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        if line.startswith("data: {"):
            yield json.loads(line[len("data: ") :])


def _join(pieces: list[dict[str, Any]]) -> Returned:
    """One choice's pieces (one, or a stream's) as one."""
    pos: list[int] = []
    toks: list[int] = []
    rows: dict[tuple[int, str], list[torch.Tensor]] = {}
    complete = None
    fetch_path = None
    late = 0
    spos: list[int] = []
    scores: dict[tuple[str, int], list[list[float | None]]] = {}
    for p in pieces:
        acts = p.get("activations")
        if isinstance(acts, dict):
            if "error" in acts:
                raise ValueError(f"the server kept no rows: {acts['error']}")
            if "fetch" in acts:
                fetch_path = acts["fetch"]
            pos += acts.get("positions", [])
            toks += acts.get("token_ids", [])
            for entry in acts.get("rows", []):
                key, t = decode_rows(entry)
                rows.setdefault(key, []).append(t)
            complete = acts.get("complete", complete)
            late = int(acts.get("late", 0))
        mon = p.get("monitor")
        if isinstance(mon, dict):
            spos += mon["positions"]
            for name, entries in mon["scores"].items():
                for e in entries:
                    scores.setdefault((name, int(e["layer"])), []).extend(e["values"])
            if complete is None and not isinstance(acts, dict):
                complete = mon.get("complete", complete)
    return Returned(
        torch.tensor(pos, dtype=torch.long),
        torch.tensor(toks, dtype=torch.long),
        {k: torch.cat(v) for k, v in rows.items()},
        complete,
        {k: _f32(v) for k, v in scores.items()},
        torch.tensor(spos, dtype=torch.long),
        fetch_path,
        late,
    )


def _f32(values: list[list[float | None]]) -> torch.Tensor:
    """Scores as the server wrote them (shortest decimals; null: not finite) as float32."""
    rows = [[np.nan if x is None else x for x in row] for row in values]
    return torch.from_numpy(np.asarray(rows, dtype=np.float64).astype(np.float32))


def from_metadata(metadata: dict[str, Any]) -> Returned:
    """What an Inspect AI ``ModelOutput.metadata`` of ``actbus/<model>`` holds."""
    return _join([metadata["actbus"]])
