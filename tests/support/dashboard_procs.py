"""Dashboard test helpers: the ``actbus dashboard`` process and a headless Chromium
driven over the DevTools protocol (a websocket from Python, no browser library)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from actbus.cli import consumer_command
from tests.support.procs import ROOT, stop, wait_for

CHROMIUM = os.environ.get("ACTBUS_CHROMIUM", "chromium")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1800",
)


def chromium_missing() -> str | None:
    """Why the browser test cannot run, or None."""
    if shutil.which(CHROMIUM) is None:
        return f"{CHROMIUM} not found: run scripts/setup.sh as root (apt-get install chromium)"
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        return "the websockets package is missing (vLLM brings it)"
    return None


class DashboardProc:
    """``actbus dashboard --port 0`` as its own process; ``url`` once it serves."""

    def __init__(self, address: str, log: Path, *flags: str) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "actbus.cli", "dashboard", "--connect", address]
        self.popen = subprocess.Popen(
            [*cmd, "--port", "0", *flags],
            stdout=open(log, "wb"),  # noqa: SIM115 (lives with the process)
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url = wait_for(self._url, 60, f"the dashboard's URL in {log}", interval=0.2)

    def _url(self) -> str | None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"dashboard exited {self.popen.returncode}: {self.log.read_text()}")
        m = re.search(r"http://127\.0\.0\.1:\d+/", self.log.read_text(errors="replace"))
        return m.group(0) if m else None

    def snapshot(self, tap: str = "") -> dict[str, Any]:
        q = f"?tap={tap}" if tap else ""
        with urllib.request.urlopen(f"{self.url}api/snapshot{q}", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        return stop(self.popen)


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, url: str, profile: Path, timeout: float = 60.0) -> None:
        from websockets.sync.client import connect

        profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(profile / "chromium.log", "wb"),  # noqa: SIM115
        )
        port_file = profile / "DevToolsActivePort"
        text = wait_for(
            lambda: port_file.exists() and port_file.read_text(), timeout, "Chromium's port"
        )
        port = int(text.split()[0])

        def page() -> str | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
            return pages[0]["webSocketDebuggerUrl"] if pages else None

        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(
            connect(wait_for(page, timeout, "a Chromium page"), max_size=64 << 20)
        )
        self._ids = itertools.count(1)
        # A page target exists before its document has loaded: wait for the dashboard's
        # DOM, or the first read would find no elements (seen on a loaded CI machine).
        wait_for(
            lambda: self.eval(
                "document.readyState === 'complete' && !!document.querySelector('#updates')"
            ),
            timeout,
            "the page to load",
        )

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()
        stop(self.proc, timeout=10)


PAGE_NUMBERS = """JSON.stringify({
  updates: +document.querySelector('#updates').textContent,
  status: document.querySelector('#status').textContent,
  last_step: document.querySelector('#bus-last-step')?.textContent ?? null,
  published: document.querySelector('#bus-published')?.textContent ?? null,
  steps_counted: document.querySelector('#me-steps')?.textContent ?? null,
  taps: [...document.querySelectorAll('#taps tbody tr')].map(r => r.dataset.tap),
  norm_means: [...document.querySelectorAll('#taps .norm-mean')].map(e => e.textContent),
  requests: document.querySelectorAll('#requests .req').length,
  request_bars: document.querySelectorAll('#requests .req svg rect').length,
  experts_hidden: document.querySelector('#experts-section').hidden,
})"""


def page_numbers(browser: Browser) -> dict[str, Any]:
    """What the page shows now, read from its DOM."""
    return json.loads(browser.eval(PAGE_NUMBERS))


PAGE_SCORES = """JSON.stringify({
  status: document.querySelector('#monitor-status').textContent,
  rows: [...document.querySelectorAll('#monitors tbody tr')].map(r => ({
    series: r.dataset.series, col: +r.dataset.col,
    column: r.querySelector('.column').textContent,
    version: +r.querySelector('.version').dataset.v, rows: +r.querySelector('.rows').dataset.v,
    mean: +r.querySelector('.mean').dataset.v, above: r.querySelector('.above').dataset.v})),
  tags: [...document.querySelectorAll('#monitor-tags tbody tr')].map(r => ({
    tag: r.dataset.tag, series: r.dataset.series, col: +r.dataset.col,
    text: r.cells[0].textContent, mean: +r.querySelector('.mean').dataset.v})),
  requests: [...document.querySelectorAll('#monitor-requests svg[data-series]')].map(s => ({
    request: s.closest('.req').dataset.request, sample: +s.closest('.req').dataset.sample,
    series: s.dataset.series, col: +s.dataset.col,
    positions: s.dataset.positions.split(',').map(Number),
    values: s.dataset.values.split(',').map(Number)})),
  html_tags: document.querySelectorAll('#monitor-section i').length,
})"""


def page_scores(browser: Browser) -> dict[str, Any]:
    """The monitor panel as the page shows it, with each number's exact value."""
    return json.loads(browser.eval(PAGE_SCORES))


def png_is_not_blank(path: Path) -> tuple[bool, str]:
    """A PNG of more than one colour (PIL if installed, else header and size)."""
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return False, "not a PNG"
    try:
        from PIL import Image
    except ImportError:
        return len(data) > 20_000, f"{len(data)} bytes (PIL missing: size only)"
    with Image.open(path) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        n = len(colours) if colours is not None else 1 << 20
        return n > 16, f"{im.size[0]}x{im.size[1]}, {n} colours"


def wandb_env(tmp_path) -> dict[str, str]:
    return {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "PYTHONUNBUFFERED": "1",
    }


def start_wandb(address: str, tmp_path, *flags: str) -> subprocess.Popen:
    log = open(tmp_path / "wandb-consumer.log", "wb")  # noqa: SIM115 (lives with the process)
    return subprocess.Popen(
        consumer_command("wandb", address, "--wandb-dir", str(tmp_path), *flags),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=wandb_env(tmp_path),
    )


PAGE_EXPERTS = """JSON.stringify({
  hidden: document.querySelector('#experts-section').hidden,
  status: document.querySelector('#experts-status').textContent,
  layers: [...document.querySelectorAll('#experts tbody tr')].map(r => ({
    layer: r.dataset.layer, tokens: +r.querySelector('.tokens').dataset.v,
    imbalance: +r.querySelector('.imbalance').dataset.v,
    counts: r.dataset.counts.split(',').map(Number),
    weights: r.dataset.weights.split(',').map(Number),
    bars: r.querySelectorAll('svg rect').length})),
})"""


def page_experts(browser: Browser) -> dict[str, Any]:
    """The expert-load panel as the page shows it, with each number's exact value."""
    return json.loads(browser.eval(PAGE_EXPERTS))
