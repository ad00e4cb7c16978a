"""The dashboard's web server (FastAPI on uvicorn) and the process that runs it.

Routes: ``/`` the page; ``/static/*`` its script and style (shipped in the
package: the page works offline); ``/api/snapshot?tap=L/H`` the latest snapshot
as JSON; ``/events?tap=L/H`` the same as server-sent events, one per update.
The consumer runs in a thread beside the server and restarts on error; the
server binds 127.0.0.1 only (activations are sensitive, there is no login).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from actbus import consumer as consumers
from actbus.bus import SubscriptionRejected
from actbus.bus.options import SubscriberOptions
from consumers.dashboard.board import Board
from consumers.dashboard.consumer import WebDashboard
from consumers.priority import lower_priority
from consumers.stats import RecentRequests, StatsConfig

STATIC = Path(__file__).parent / "static"
HOST = "127.0.0.1"
PING_S = 15.0
log = logging.getLogger("actbus.dashboard")


def make_app(board: Board, poll_s: float = 0.2) -> FastAPI:
    app = FastAPI(title="actbus dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/api/snapshot")
    def snapshot(tap: str | None = None) -> JSONResponse:
        return JSONResponse(board.view(tap))

    @app.get("/events")
    async def events(request: Request, tap: str | None = None) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            seen, idle = -1, 0.0
            yield "retry: 1000\n\n"
            while not board.closed.is_set() and not await request.is_disconnected():
                if board.version != seen:
                    view = board.view(tap)
                    seen = view["version"]
                    idle = 0.0
                    yield f"id: {seen}\ndata: {json.dumps(view)}\n\n"
                elif idle >= PING_S:  # keeps proxies and idle timers from closing it
                    idle = 0.0
                    yield ": ping\n\n"
                await asyncio.sleep(poll_s)
                idle += poll_s

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    return app


def serve(
    args: argparse.Namespace, options: SubscriberOptions, parser: argparse.ArgumentParser
) -> int:
    """``actbus dashboard``: the consumer thread and the web server, until a signal."""
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0..65535, got {args.port}")
    if args.interval <= 0:
        parser.error(f"--interval must be above 0 seconds, got {args.interval}")
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    try:
        config = StatsConfig(bins=args.bins, outlier_k=args.outlier_k)
    except ValueError as e:
        parser.error(str(e).replace("StatsConfig.", "--").replace("_", "-"))
    lower_priority(args.nice, args.sched)  # before the server and consumer threads start
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    board = Board(RecentRequests(keep=args.requests))
    make = functools.partial(
        WebDashboard,
        options.connect,
        board,
        interval_s=args.interval,
        config=config,
        **options.keys,
    )
    stop = threading.Event()
    failed: list[BaseException] = []

    def consume() -> None:
        try:
            out = consumers.run(
                make,
                options.connect,
                subscription=options.consumer_subscription,
                restart=consumers.RestartPolicy(on_error="restart"),
                stop=stop,
                **options.keys,
            )
            log.info("consumer stopped: received=%d missed=%d", out.received, out.missed)
        except SubscriptionRejected as e:
            failed.append(e)
            print(f"actbus dashboard: {e}", file=sys.stderr)
            server.should_exit = True

    server = _Server(
        uvicorn.Config(
            make_app(board),
            host=HOST,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
            lifespan="off",
        )
    )
    thread = threading.Thread(target=consume, name="actbus-dashboard-consumer", daemon=True)
    thread.start()
    threading.Thread(target=_announce, args=(server,), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        board.closed.set()
        stop.set()
        thread.join(timeout=10)
    return 1 if failed else 0


class _Server(uvicorn.Server):
    """uvicorn re-raises the signals it caught once it stops, so a SIGTERM'd dashboard
    would exit -15; here the command owns its signals and exits 0 when asked to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _announce(server: object) -> None:
    """Print the URL once the socket is bound (with --port 0 the port is chosen then)."""
    import time

    for _ in range(600):
        if getattr(server, "started", False):
            for s in getattr(server, "servers", []):
                for sock in s.sockets:
                    host, port = sock.getsockname()[:2]
                    print(f"actbus dashboard: http://{host}:{port}/", flush=True)
                    return
        time.sleep(0.05)
