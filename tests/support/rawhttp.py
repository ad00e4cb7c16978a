"""HTTP clients as hostile peers behave, on real sockets: ones that send a request and
never read the answer, from a loopback address of their choosing (a client of its own
to the server); and what the server process holds meanwhile (its memory, its metrics,
its counts of returned rows)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from urllib.parse import urlparse

import psutil


def post_unread(base: str, path: str, body: dict, source: str = "127.0.0.1") -> socket.socket:
    """POST ``body`` as JSON and read nothing: the socket's receive buffer is made
    small first, so what the server sends waits in the server, not in this kernel."""
    u = urlparse(base)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((source, 0))
    s.connect((u.hostname, u.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def status_of(s: socket.socket, timeout: float) -> int:
    """The status of the answer that started arriving on ``s``, left unread."""
    s.settimeout(timeout)
    head = s.recv(12, socket.MSG_PEEK)
    return int(head[9:12])


def body_started(s: socket.socket, timeout: float) -> bytes:
    """What has arrived on ``s``, left unread, once the answer's body has begun (a
    stream's first event: the server has made it)."""
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
        got = s.recv(1 << 16, socket.MSG_PEEK)
        head = got.find(b"\r\n\r\n")
        if not got or (head >= 0 and len(got) > head + 4):
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no body after {timeout}s: {got[:200]!r}")
        time.sleep(0.01)


def reset_peak(proc: psutil.Process) -> None:
    """Start ``proc``'s peak resident memory (``peak_rss``) over from what it has now."""
    with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
        f.write("5")


def peak_rss(proc: psutil.Process) -> int:
    """The most memory ``proc`` had resident since it started or ``reset_peak``: growth
    that comes and goes between two looks at its size shows here."""
    with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no VmHWM for process {proc.pid}")


def api_server(proc: psutil.Process | int) -> psutil.Process:
    """The process that serves HTTP under ``actbus serve`` (its child: vLLM's API server)."""
    top = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
    for p in [top, *top.children(recursive=True)]:
        if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
            return p
    raise LookupError("no vLLM API server under this process")


def metric(base: str, name: str) -> float:
    """The sum of a Prometheus gauge of the server's ``/metrics``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def returns_stats(base: str) -> dict:
    """``GET /v1/actbus/returns``: what the server holds for HTTP callers, and what it
    refused or dropped."""
    with urllib.request.urlopen(f"{base}/v1/actbus/returns", timeout=30) as r:
        return json.loads(r.read())
