"""One HTTP call to the OpenAI server, as the budget of returned rows sees it.

A call may carry several prompts (a completion's ``prompt`` list), each with ``n``
samples: what they may get back is bounded together (``actbus.capture.http``), and
stays reserved until the call's response has been handed to its socket. A client that
never reads keeps its call's share held, no more: the server's limit, not the number
of open connections, bounds what unread responses hold. The client is the peer's
address as the server sees it (uvicorn's ``--forwarded-allow-ips`` says whether a
proxy's header counts); rows kept for fetching are shared out by it.

actbus's middleware (``actbus.engine.routes``) runs every request to vLLM inside a
call (``around``): a context variable that the request's tasks inherit, read where
the front end admits a prompt (``actbus.engine.frontend``). A streamed call's chunks
take their rows themselves (``STREAMED``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

CURRENT: ContextVar[HttpCall | None] = ContextVar("actbus_http_call", default=None)
"""The HTTP call the running request belongs to; None outside one."""
STREAMED: ContextVar[bool] = ContextVar("actbus_streamed", default=False)
"""True inside vLLM's SSE generator of a call, as ``actbus.engine.responses`` runs it
(its prompts are read there): its inline rows go out by its chunks."""


class HttpCall:
    """The prompts of one HTTP call that asked rows back: what they were admitted for,
    and their reservations (kept alive here until the call ends)."""

    def __init__(self, client: str) -> None:
        self.client = client
        self.admitted = 0
        """Bytes its prompts were admitted for, in all."""
        self.prompts = 0
        self._tickets: list[Any] = []

    def hold(self, ticket: Any, nbytes: int) -> None:
        """A prompt admitted for ``nbytes``: its reservation lasts as long as the call."""
        self._tickets.append(ticket)
        self.admitted += nbytes
        self.prompts += 1

    def close(self) -> set[int]:
        """The call is over: the tokens of its reservations, let go here."""
        tokens = {t.token for t in self._tickets}
        self._tickets.clear()
        return tokens


def peer(scope: dict[str, Any]) -> str:
    """The client of an ASGI request: its peer's host."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def _end(call: HttpCall) -> None:
    from actbus.capture import http

    bounds = http.current()
    if bounds is not None:
        bounds.end_call(call)
    else:
        call.close()


PIECE = 1 << 20
"""A body is handed to the socket in pieces of this size: the server's transport copies
what the kernel does not take, so a whole body would be held twice while unread."""


class _UntilSent:
    """A response whose call ends once its last byte went to the socket, or its
    sending stopped (the client went away)."""

    def __init__(self, response: Any, call: HttpCall) -> None:
        self.response, self.call = response, call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def in_pieces(message: dict[str, Any]) -> None:
            body = message.get("body", b"")
            if message["type"] != "http.response.body" or len(body) <= PIECE:
                return await send(message)
            more, view = message.get("more_body", False), memoryview(body)
            for at in range(0, len(body), PIECE):
                last = at + PIECE >= len(body)
                piece = bytes(view[at : at + PIECE])
                await send({"type": message["type"], "body": piece, "more_body": more or not last})

        try:
            await self.response(scope, receive, in_pieces)
        finally:
            _end(self.call)


async def around(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """``call_next(request)`` inside an HTTP call, its response sent before the call's
    reservations end."""
    call = HttpCall(peer(request.scope))
    token = CURRENT.set(call)
    try:
        response = await call_next(request)
    except BaseException:
        _end(call)
        raise
    finally:
        CURRENT.reset(token)
    return _UntilSent(response, call)
