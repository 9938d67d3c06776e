"""Headless Chromium for the tests that check what a user sees (Prefect UI, ``dvc plots show``).

Debian's ``chromium`` package; the tests that need it skip cleanly when it is absent (CI installs it
only where it can). Driven through the DevTools protocol over a websocket: open a page, wait for a
JavaScript condition, evaluate an expression, take a screenshot. Every wait is bounded.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from tests.processes import stop

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One browser tab: ``goto``, ``wait_for``, ``evaluate``, ``screenshot``."""

    def __init__(self, ws) -> None:
        self.ws, self.ids = ws, itertools.count(1)

    def call(self, method: str, **params: Any) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll ``expression`` until it is truthy; its value, or AssertionError with the page text."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                value = self.evaluate(expression)
                if value:
                    return value
            time.sleep(0.5)
        text = self.evaluate("document.body ? document.body.innerText.slice(0, 2000) : ''")
        raise AssertionError(f"page never satisfied {expression!r} in {timeout:.0f}s; it shows:\n{text}")

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png",
                                                    captureBeyondViewport=True)["data"]))
        return path


@contextlib.contextmanager
def browser(width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """A headless Chromium with one page ``width`` x ``height`` CSS pixels; stopped on the way out."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed")
    # Chromium's helper processes (renderer, crashpad) live in its session and may still write to the
    # profile when the browser itself has exited: the whole session is stopped, and a file they left
    # behind does not fail the test that used the page.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                 f"--window-size={width},{height}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not port_file.is_file() or not port_file.read_text().strip():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("chromium did not start its DevTools endpoint in 60 s")
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            target = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                          if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
                page = Page(ws)
                page.call("Page.enable")
                page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                          mobile=False)
                yield page
        finally:
            stop(proc, stragglers=True)

