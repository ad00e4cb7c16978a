"""An HTTP server that refuses every call as vLLM's OpenAI server refuses a bad one: a
status and ``{"error": {"message": ...}}``. A client's handling of a refusal is tested
against it without an engine start."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def refusing_server(status: int, message: str) -> Iterator[int]:
    """A server on a free loopback port (yielded) that answers every GET and POST with
    ``status`` and ``message``, in vLLM's error body."""
    body = json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    ).encode()

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

        def log_message(self, *_args: object) -> None:  # quiet: the test reads the client
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
