"""Named vectors and global steering over HTTP, on vLLM's OpenAI server.

``actbus serve`` adds ``middleware`` below with vLLM's own ``--middleware`` flag. It
answers ``/v1/actbus/...`` itself and passes every other request on:

- ``GET /v1/actbus/vectors``: the names with their norms and digests;
- ``PUT /v1/actbus/vectors/NAME``: body ``{"values": [...]}`` or a source
  (``{"sae": DIR, "feature": I}``, ``{"probe": DIR, "head": TAG}``,
  ``{"file": PATH, "key": TENSOR}``, paths on the server's host);
- ``DELETE /v1/actbus/vectors/NAME``;
- ``GET`` / ``PUT /v1/actbus/steer/global``: body ``{"entries": [...]}``;
- ``GET /v1/actbus/returns/ID``: a response's rows kept for fetching (``"return":
  "fetch"``), once, as safetensors; behind the completions' own key (``--api-key``),
  not the admin key, and the ID (random, 192 bits) is the caller's alone;
- ``GET /v1/actbus/returns``: the rows held for HTTP callers, and every request and
  choice refused or dropped by the limits (``HttpReturns.stats``), behind the same key.

Every other POST (a completion) runs inside an HTTP call (``actbus.capture.calls``):
what its prompts reserve for returned rows lasts until its response is sent.

Middleware added this way runs before vLLM's API-key check, so it checks for itself.
With an admin key (``actbus serve --actbus-admin-key``, or ``ACTBUS_ADMIN_KEY`` in the
server's environment) every call must carry that key as a bearer token, and the
completion key (``--api-key``) is not enough: a client that may generate cannot change
what every request is steered with. Without one, the API key (``--api-key`` or
``VLLM_API_KEY``) is asked for; without either, only loopback clients are served.

A body is at most ``MAX_BODY_BYTES``, refused from its ``Content-Length`` or as it
arrives, and parsed within bounds (``actbus.jsontext``); the work of a call (loading a
file, resolving entries) runs on a worker thread, not on the event loop every other
request waits on. Path sources are read only inside ``actbus.steer.vector_dirs``
(``actbus.checkpoints.Confine``).
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from actbus.capture import calls
from actbus.capture.http import FETCH_PATH
from actbus.engine.api import steering
from actbus.errors import ConfigError
from actbus.jsontext import parse_json_text
from actbus.steer.config import ADMIN_KEY_ENV, VectorSource

PREFIX = "/v1/actbus/"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
RETURNS_PATH = FETCH_PATH.rstrip("/")
"""``GET``: what the server holds for HTTP callers, and what it refused or dropped."""
MAX_BODY_BYTES = 8 << 20
"""A call's body: global entries with inline vectors of a wide model fit."""


def _tokens(request: Any) -> tuple[list[str], str]:
    """The keys that open the endpoints, and what they are called in a refusal."""
    admin = os.environ.get(ADMIN_KEY_ENV)
    if admin:
        return [admin], "the server's admin key (--actbus-admin-key)"
    return _api_keys(request), "the server's API key"


def _api_keys(request: Any) -> list[str]:
    args = getattr(request.app.state, "args", None)
    keys = getattr(args, "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or [os.environ.get("VLLM_API_KEY")]) if k]


def _bearer_ok(request: Any, tokens: list[str]) -> bool:
    given = request.headers.get("authorization", "")
    return given.startswith("Bearer ") and any(
        hmac.compare_digest(given[7:].encode(), t.encode()) for t in tokens
    )


def _fetch(request: Any) -> Any:
    """``GET /v1/actbus/returns/ID`` (and ``GET /v1/actbus/returns``, the counts):
    behind the API key, as the completion was."""
    from fastapi.responses import JSONResponse, Response

    from actbus.capture import http

    keys = _api_keys(request)
    if keys and not _bearer_ok(request, keys):
        return JSONResponse({"error": "actbus: fetching rows needs the server's API key"}, 401)
    if request.method != "GET":
        return JSONResponse({"error": f"{request.method}: fetch rows with GET"}, 405)
    bounds = http.current()
    if request.url.path == RETURNS_PATH:
        return JSONResponse(http.stats())
    key = request.url.path[len(http.FETCH_PATH) :]
    blob = bounds.take(key) if bounds is not None and len(key) <= 64 else None
    if blob is None:
        return JSONResponse(
            {"error": "no such rows: never kept, fetched already, or expired "
             "(http_return_fetch_ttl_s)"},
            404,
        )  # fmt: skip
    return Response(blob, media_type="application/octet-stream")


def _denied(request: Any) -> tuple[int, str] | None:
    tokens, what = _tokens(request)
    if tokens:
        ok = _bearer_ok(request, tokens)
        return None if ok else (401, f"actbus: steering endpoints need {what}")
    host = request.client.host if request.client else ""
    if host in LOOPBACK:
        return None
    return (403, "actbus: without --api-key, steering endpoints serve loopback clients only")


class BodyTooLarge(ConfigError):
    """HTTP 413."""


async def _body(request: Any) -> bytes:
    """The body, read only up to ``MAX_BODY_BYTES`` (``BodyTooLarge`` beyond)."""
    too_big = BodyTooLarge(
        f"body: more than {MAX_BODY_BYTES} bytes; register large vectors one by one"
    )
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def middleware(request: Any, call_next: Any) -> Any:
    """Answer ``/v1/actbus/...``; everything else goes to vLLM."""
    path = request.url.path
    if not path.startswith(PREFIX):
        if request.method == "POST":  # a completion: its returned rows' HTTP call
            return await calls.around(request, call_next)
        return await call_next(request)
    if path.startswith(FETCH_PATH) or path == RETURNS_PATH:
        return _fetch(request)
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    denied = _denied(request)
    if denied is not None:
        return JSONResponse({"error": denied[1]}, status_code=denied[0])
    try:
        body: Any = None
        if request.method == "PUT":
            raw = await _body(request)
            body = parse_json_text(raw, "body", MAX_BODY_BYTES) if raw else None
        engine = request.app.state.engine_client
        status, out = await run_in_threadpool(_handle, engine, request.method, path, body)
    except ConfigError as e:
        status, out = (413 if isinstance(e, BodyTooLarge) else 400), {"error": str(e)}
    except KeyError as e:
        status, out = 404, {"error": str(e.args[0])}
    return JSONResponse(out, status_code=status)


def _handle(engine: Any, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    steer = steering(engine)
    reg = steer.registry
    parts = path[len(PREFIX) :].strip("/").split("/")
    if parts == ["vectors"] and method == "GET":
        return 200, {"vectors": [_describe(n, reg.get(n, "name")) for n in reg.names()]}
    if len(parts) == 2 and parts[0] == "vectors" and method in ("PUT", "DELETE"):
        name = parts[1]
        if method == "DELETE":
            reg.remove(name)
            return 200, {"removed": name}
        if not isinstance(body, dict):
            raise ConfigError(
                "body: expected {'values': [...]} or a source such as {'sae': DIR, 'feature': 3}"
            )
        if "values" in body:
            if set(body) != {"values"}:
                raise ConfigError("body: 'values' goes alone")
            values = body["values"]
            if not isinstance(values, list):
                raise ConfigError("body.values: expected a list of floats")
            vec = reg.register(name, values)
        else:
            vec = reg.register(name, VectorSource.from_dict(body, "body"), confine=steer.confine)
        return 200, _describe(name, vec)
    if parts == ["steer", "global"] and method == "GET":
        return 200, {"entries": [r.key() for r in steer.global_entries]}
    if parts == ["steer", "global"] and method == "PUT":
        if not isinstance(body, dict) or set(body) != {"entries"}:
            raise ConfigError("body: expected {'entries': [...]} (a request's steer list)")
        steer.set_global(body["entries"], trusted=False)
        return 200, {"entries": len(steer.global_entries)}
    raise KeyError(f"{method} {path}: no such actbus endpoint")


def _describe(name: str, vec: Any) -> dict[str, Any]:
    return {"name": name, "norm": vec.norm, "digest": vec.digest, "width": len(vec.values)}
