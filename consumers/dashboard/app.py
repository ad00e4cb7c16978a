"""The dashboard's web server (FastAPI on uvicorn) and the process that runs it.

Routes: ``/`` the page; ``/static/*`` its script and style (shipped in the
package: the page works offline); ``/api/snapshot?tap=L/H`` the latest snapshot
as JSON (with the event streams' counters); ``/events?tap=L/H`` the same as
server-sent events, one per update (``events.py``: encoded once for all pages,
slow pages dropped). Snapshots say whether their feed is live or stale. The
consumer runs in a thread beside the server and restarts on error; the server
binds 127.0.0.1 only (activations are sensitive, there is no login).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from actbus import consumer as consumers
from actbus.bus import SubscriptionRejected
from actbus.bus.options import SubscriberOptions
from actbus.logcap import capped_text
from consumers.dashboard.board import Board
from consumers.dashboard.consumer import WebDashboard
from consumers.dashboard.events import Events, dumps
from consumers.priority import lower_priority
from consumers.scores import ScoreStatsConfig
from consumers.stats import RecentRequests, StatsConfig

STATIC = Path(__file__).parent / "static"
HOST = "127.0.0.1"
SEND_BUFFER = 256 << 10
"""Kernel send buffer of each connection (see ``_listen``)."""
log = logging.getLogger("actbus.dashboard")


def make_app(board: Board, poll_s: float = 0.2, slow_s: float = 10.0) -> FastAPI:
    app = FastAPI(title="actbus dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    events = Events(board, poll_s=poll_s, slow_s=slow_s)

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/api/snapshot")
    def snapshot(tap: str | None = None) -> Response:
        view = {**board.view(tap), "events": events.counters()}
        return Response(dumps(view), media_type="application/json")

    @app.get("/events")
    async def stream(tap: str | None = None) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            events.stream(tap), media_type="text/event-stream", headers=headers
        )

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
    if args.stale_s is not None and args.stale_s <= 0:
        parser.error(f"--stale-s must be above 0 seconds, got {args.stale_s}")
    if args.slow_client_s <= 0:
        parser.error(f"--slow-client-s must be above 0 seconds, got {args.slow_client_s}")
    try:
        config = StatsConfig(bins=args.bins, outlier_k=args.outlier_k)
    except ValueError as e:
        parser.error(str(e).replace("StatsConfig.", "--").replace("_", "-"))
    try:
        listener = _listen(args.port)
    except OSError as e:
        print(f"actbus dashboard: cannot listen on {HOST}:{args.port}: {e}", file=sys.stderr)
        return 1
    lower_priority(args.nice, args.sched)  # before the server and consumer threads start
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    stale_s = args.stale_s if args.stale_s is not None else max(5.0, 3 * args.interval)
    board = Board(RecentRequests(keep=args.requests), stale_s=stale_s)
    make = functools.partial(
        WebDashboard,
        options.connect,
        board,
        interval_s=args.interval,
        config=config,
        monitor_scores=args.monitor_scores,
        expert_load=args.expert_load,
        score_config=ScoreStatsConfig(keep_requests=args.requests),
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
                exit_on_end=args.exit_on_end,
                **options.keys,
            )
            log.info("consumer stopped: received=%d missed=%d", out.received, out.missed)
            if out.failure is not None:
                board.stop(capped_text(f"{out.failure}; gave up after {out.restarts} restarts"))
            elif not stop.is_set():  # the stream ended (not --keep-waiting): so does the page
                board.closed.set()
                server.should_exit = True
        except SubscriptionRejected as e:
            failed.append(e)
            print(f"actbus dashboard: {e}", file=sys.stderr)
            server.should_exit = True

    server = _Server(
        uvicorn.Config(
            make_app(board, slow_s=args.slow_client_s),
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

    def shut(*_: object) -> None:
        board.closed.set()  # open event streams end, so the server stops at once
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, shut)
    try:
        server.run(sockets=[listener])
    finally:
        board.closed.set()
        stop.set()
        thread.join(timeout=10)
    return 1 if failed else 0


def _listen(port: int) -> socket.socket:
    """The server's socket on 127.0.0.1. The connections it accepts inherit its send
    buffer, fixed at ``SEND_BUFFER``: a page that never reads then holds that much of
    the kernel's memory, where autotuned buffers grew to megabytes each and 400 such
    pages cost the host seconds of CPU while they filled."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        raise
    return sock


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
