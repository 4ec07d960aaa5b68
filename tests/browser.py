"""Headless Chromium driven over the DevTools protocol, for UI checks as a person would make them: open a page,
click a tab by its label, read the visible text, take a screenshot.

Debian's `chromium` package (`apt-get install chromium`; `.ci/run` installs it). Tests that need it skip with that
hint when it is missing. Screenshots go to test-output/screenshots/ (kept after the run).
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

SCREENSHOTS = Path(__file__).resolve().parents[1] / "test-output" / "screenshots"


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, width: int = 1500, height: int = 1000):
        path = chromium()
        if path is None:
            pytest.skip("headless Chromium is not installed: `apt-get install chromium` (Debian) runs the UI tests")
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)  # Chromium may still write
        self.process = subprocess.Popen(
            [
                path,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--hide-scrollbars",
                f"--window-size={width},{height}",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile.name}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = None
        for line in self.process.stderr:
            if match := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                port = match.group(1)
                break
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        from websockets.sync.client import connect

        self.socket = connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024)
        self.ids = itertools.count(1)

    def _call(self, method: str, **params):
        call_id = next(self.ids)
        self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def _eval(self, expression: str):
        return self._call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, wait_for: str, timeout_s: float = 30) -> str:
        """Load ``url`` and wait until its visible text contains ``wait_for``; returns that text."""
        self._call("Page.navigate", url=url)
        return self.wait_for_text(wait_for, timeout_s)

    def wait_for_text(self, needle: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self._eval("document.body ? document.body.innerText : ''") or ""
            if needle in text:
                return text
            time.sleep(0.5)
        raise AssertionError(f"{needle!r} did not appear on the page; it shows:\n{text[:3000]}")

    def click(self, label: str) -> None:
        """Click the first button, link or tab whose text is ``label``."""
        found = self._eval(
            "(() => { const el = [...document.querySelectorAll('button, a, [role=tab], li, span')]"
            f".find(e => e.textContent.trim() === {json.dumps(label)});"
            " if (el) { el.click(); return true; } return false; })()"
        )
        assert found, f"nothing labelled {label!r} to click"

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        path.write_bytes(base64.b64decode(self._call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(10)
        self.profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
