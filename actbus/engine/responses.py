"""Returned monitor scores and activations in vLLM's OpenAI server responses.

A request that asks (``"monitor_return": true``, ``"return": true`` or ``"fetch"`` in its
``vllm_xargs`` actbus entry) gets, in each of its choices, ``"actbus": {"monitor":
{...}, "activations": {...}}``: what came with the output the choice was made from
(``MonitorScores.to_json``, ``actbus.capture.http.to_json``; the formats are in
docs/monitors.md and docs/http.md). Non-streaming responses carry every position's
in each choice. Streamed, each chunk carries the scores that arrived since the previous
chunk of its choice, and the rows of exactly the tokens it carries: an output of such a
choice owes rows up to its tokens (``Due``), noted when vLLM's generator reads it
(``_Reading``), and the chunk made next awaits them, at most
``http_return_chunk_wait_s``, before it is sent; on the event loop, never blocking it.
Either way a stream carries every position once. Rows asked with ``"fetch"`` are kept
(``actbus.capture.http``) when the choice's final output is made, and the choice names
where to fetch them.

vLLM's serving classes build the choices from the engine's outputs; the wrappers
here watch the outputs go by (the ``result_generator`` the serving method reads) and
add the field to the choices made from them, without touching how vLLM makes them.
Other requests' responses are left byte for byte as vLLM wrote them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("actbus")

# (module, class, streaming method, full method, choice index of an output: "completion"
# numbers choices across prompts, "chat" has one prompt).
_TARGETS = (
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "completion"),
    ("vllm.entrypoints.openai.serving_completion", "OpenAIServingCompletion", "completion"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat"),
    ("vllm.entrypoints.openai.serving_chat", "OpenAIServingChat", "chat"),
)
_STREAM = {"completion": "completion_stream_generator", "chat": "chat_completion_stream_generator"}
_FULL = {
    "completion": "request_output_to_completion_response",
    "chat": "chat_completion_full_generator",
}


def patch(force: bool = False) -> list[str]:
    """Wrap the serving classes of a process that serves HTTP (one that imported
    vLLM's OpenAI server, or ``force``); returns what was wrapped."""
    if not force and not any(m.startswith("vllm.entrypoints.openai") for m in sys.modules):
        return []
    done = []
    for mod_name, cls_name, kind in _TARGETS:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        if cls.__dict__.get("_actbus_scores"):
            done.append(f"{mod_name}.{cls_name}")
            continue
        stream = getattr(cls, _STREAM[kind], None)
        full = getattr(cls, _FULL[kind], None)
        if stream is None or full is None:
            log.warning("actbus: %s has no %s; no scores in its responses", cls_name, _STREAM[kind])
            continue
        setattr(cls, _STREAM[kind], _wrap_stream(stream, kind))
        if kind == "completion":
            setattr(cls, _FULL[kind], _wrap_completion_full(full))
        else:
            setattr(cls, _FULL[kind], _wrap_chat_full(full))
        cls._actbus_scores = True
        done.append(f"{mod_name}.{cls_name}")
    return done


class _Choice:
    """What one choice's outputs brought that no chunk has carried yet."""

    def __init__(self) -> None:
        self.scores: Any = None
        self.rows: list[Any] = []  # Activations pieces, in order
        self.final = False
        self.fetch: str | None = None
        """The sample's id when its rows are kept for fetching."""
        self.last: Any = None
        """A streamed choice whose chunks take its rows: the latest ``Due`` seen."""
        self.due: Any = None
        """The ``Due`` of the latest output vLLM read: what its next chunk is owed."""
        self.owed_to = 0
        """The limit its previous chunk's rows reached (or waited for)."""
        self.rows_final = False
        """Its final chunk's rows were taken (the sample is let go)."""

    def seen(self, out: Any) -> bool:
        from actbus.capture.returns import Due
        from actbus.monitor.returns import MonitorScores

        ms = getattr(out, "monitor_scores", None)
        acts = getattr(out, "activations", None)
        if ms is not None:
            self.scores = MonitorScores.join(self.scores, ms)
        if isinstance(acts, Due):
            self.last = acts
        elif acts is not None:
            self.rows.append(acts)
            self.fetch = getattr(out, "actbus_fetch", None) or None
        if out.finish_reason is not None:
            self.final = True
        return ms is not None or acts is not None

    def read(self, due: Any) -> None:
        """vLLM's generator reads the output owing ``due``: the chunk it makes next
        carries that output's tokens."""
        self.due = due

    async def take(self) -> None:
        """A chunk of this choice is about to go: the rows its tokens owe, waited for
        when they are new (at most ``http_return_chunk_wait_s``; the final chunk as a
        final output waits), or those of earlier chunks that came since."""
        due = self.due
        if due is None or self.rows_final:
            return
        from actbus.capture import http

        bounds = http.current()
        new = due.limit > self.owed_to
        wait_s = (bounds.chunk_wait_s if bounds else http.CHUNK_WAIT_S) if new else 0.0
        acts, waited = await due.collector.rows_for(due, wait_s)
        before, self.owed_to = self.owed_to, due.limit
        if due.final:
            self.rows_final, self.due = True, None
        if acts is None:  # let go (an abort): nothing more comes
            self.rows_final = True
            return
        if bounds is not None:
            carried = int((acts.positions < before).sum()) if before else 0
            bounds.chunk_sent(waited, acts.late, carried)
        self.rows = [acts]

    def field(self) -> dict[str, Any] | None:
        """The ``actbus`` field of the next chunk of this choice; what it carries is
        let go (rows to fetch wait for the final output)."""
        out: dict[str, Any] = {}
        if self.scores is not None:
            out["monitor"] = self.scores.to_json(self.final)
            self.scores = None
        if self.rows and (self.final or not self.fetch):
            final = self.rows_final if self.last is not None else self.final
            out["activations"] = _rows_field(_joined(self.rows), final, self.fetch)
            self.rows = []
        return out or None

    def spent(self) -> bool:
        """Nothing left for a later chunk: no scores, no rows, none owed."""
        owes = self.last is not None and not self.rows_final
        return self.scores is None and not self.rows and not owes

    def release(self) -> None:
        """The stream ended before this choice's final chunk: its rows are let go."""
        if self.last is not None and not self.rows_final:
            self.rows_final = True
            self.last.collector.release(self.last.key)


class _Reading(list):
    """An item's outputs, noting each one as vLLM's stream generator reads it: the
    chunk it makes next carries that output's tokens (one made before, like a chat
    stream's first, with the role, carries none)."""

    def __init__(self, outputs: list[Any], reads: list[Callable[[], None] | None]) -> None:
        super().__init__(outputs)
        self._reads = reads

    def __iter__(self) -> Iterator[Any]:
        for out, read in zip(list.__iter__(self), self._reads, strict=False):
            if read is not None:
                read()
            yield out


def _joined(pieces: list[Any]) -> Any:
    """Consecutive pieces of one choice's rows as one, concatenated once."""
    if len(pieces) == 1:
        return pieces[0]
    import torch

    from actbus.capture.returns import Activations

    keys = pieces[-1].tensors.keys()
    return Activations(
        torch.cat([p.positions for p in pieces]),
        torch.cat([p.token_ids for p in pieces]),
        {k: torch.cat([p.tensors[k] for p in pieces]) for k in keys},
        pieces[-1].complete,
    )


def _rows_field(acts: Any, final: bool, fetch: str | None) -> dict[str, Any]:
    """Inline rows, or (``fetch``: the sample's id) where its rows are kept."""
    from actbus.capture import http

    if not fetch:
        return http.to_json(acts, final)
    blob = http.to_safetensors(acts)
    bounds = http.current()
    key = bounds.put(blob, fetch) if bounds is not None else None
    if key is None:
        return {
            "error": "the server holds no more rows for fetching (http_return_max_server_mb, "
            "or this client's http_return_fetch_client_mb); fetch earlier responses or retry",
            "complete": False,
        }
    return {
        "fetch": http.FETCH_PATH + key,
        "bytes": len(blob),
        "expires_in_s": bounds.ttl_s,
        "rows": len(acts.positions),
        "complete": acts.complete,
    }


def _field(out: Any) -> dict[str, Any] | None:
    """The ``actbus`` field of a choice made from one final output."""
    c = _Choice()
    return c.field() if c.seen(out) else None


def _choices_of(item: Any, kind: str, n: int) -> list[tuple[int, Any]]:
    """(choice index, output) of each output in one item of ``result_generator``."""
    if kind == "completion":
        prompt_idx, res = item
        return [(o.index + prompt_idx * n, o) for o in res.outputs]
    return [(o.index, o) for o in item.outputs]


def _with_result_tap(orig, kind: str, seen):
    """``orig`` with its ``result_generator`` argument read through ``seen(item)``."""
    sig = inspect.signature(orig)

    def rebind(self, args, kwargs):
        bound = sig.bind(self, *args, **kwargs)
        source = bound.arguments["result_generator"]

        async def tap():
            async for item in source:
                seen(bound.arguments["request"], item)
                yield item

        bound.arguments["result_generator"] = tap()
        return bound

    return rebind


def _wrap_stream(orig, kind: str):
    sig = inspect.signature(orig)
    if "result_generator" not in sig.parameters:
        return orig

    @functools.wraps(orig)
    async def stream(self, *args: Any, **kwargs: Any):
        from actbus.capture import calls

        waiting: dict[int, _Choice] = {}  # choice -> what no chunk carried yet

        def seen(request: Any, item: Any) -> None:
            reads: list[Callable[[], None] | None] = []
            for i, out in _choices_of(item, kind, int(getattr(request, "n", 1) or 1)):
                c = waiting.get(i) or _Choice()
                if c.seen(out):
                    waiting[i] = c
                due = c.last if c.last is getattr(out, "activations", None) else None
                reads.append(functools.partial(c.read, due) if due is not None else None)
            if any(reads):
                res = item[1] if kind == "completion" else item
                res.outputs = _Reading(res.outputs, reads)

        bound = _with_result_tap(orig, kind, seen)(self, args, kwargs)
        # The prompts are read inside this generator: their rows go out by its chunks.
        token = calls.STREAMED.set(True)
        chunks = orig(*bound.args, **bound.kwargs)
        try:
            async for chunk in chunks:
                if waiting and isinstance(chunk, str) and chunk.startswith("data: {"):
                    chunk = await _add_to_chunk(chunk, waiting)
                yield chunk
        finally:  # a client gone mid-stream: vLLM's own generator cleans up (aborts)
            await chunks.aclose()
            for c in waiting.values():
                c.release()
            waiting.clear()
            with contextlib.suppress(ValueError):  # closed from another context
                calls.STREAMED.reset(token)

    return stream


async def _add_to_chunk(chunk: str, waiting: dict[int, _Choice]) -> str:
    body = chunk[len("data: ") :].rstrip("\n")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return chunk
    added = False
    for choice in obj.get("choices") or ():
        i = choice.get("index")
        c = waiting.get(i) if isinstance(i, int) else None
        if c is None:
            continue
        await c.take()
        field = c.field()
        if c.spent():
            del waiting[i]
        if field is not None:
            choice["actbus"] = field
            added = True
    if not added:
        return chunk
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _wrap_completion_full(orig):
    @functools.wraps(orig)
    def full(self, final_res_batch, *args: Any, **kwargs: Any):
        response = orig(self, final_res_batch, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]
        choices = getattr(response, "choices", None) or []
        if len(choices) == len(outputs):  # one choice per output, in order
            for choice, out in zip(choices, outputs, strict=True):
                field = _field(out)
                if field is not None:
                    setattr(choice, "actbus", field)  # noqa: B010
        return response

    return full


def _wrap_chat_full(orig):
    sig = inspect.signature(orig)
    if "result_generator" not in sig.parameters:
        return orig

    @functools.wraps(orig)
    async def full(self, *args: Any, **kwargs: Any):
        last: dict[int, Any] = {}

        def seen(request: Any, item: Any) -> None:
            for i, out in _choices_of(item, "chat", 1):
                if getattr(out, "monitor_scores", None) or getattr(out, "activations", None):
                    last[i] = out

        bound = _with_result_tap(orig, "chat", seen)(self, args, kwargs)
        response = await orig(*bound.args, **bound.kwargs)
        for choice in getattr(response, "choices", None) or []:
            out = last.get(getattr(choice, "index", -1))
            field = _field(out) if out is not None else None
            if field is not None:
                setattr(choice, "actbus", field)  # noqa: B010
        return response

    return full
