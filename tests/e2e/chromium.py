"""Debian's headless chromium, driven over the DevTools protocol (aiohttp's WebSocket client, no
other library): a live page never finishes loading, so `--dump-dom` cannot read it; the tests
evaluate JavaScript in it instead, and wait for what they expect to appear."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", "--window-size=1400,800")


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One browser with a fresh profile in `profile`, one page (`open`, `evaluate`, `wait_for`)."""

    def __init__(self, profile: Path) -> None:
        exe = executable()
        if exe is None:
            raise RuntimeError("no chromium on PATH (apt-get install chromium)")
        self._log = open(profile.parent / "chromium.log", "w+b")
        self._proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=self._log)
        self._ids = itertools.count(1)
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._http: aiohttp.ClientSession | None = None
        self._session = ""
        self._events: list[dict[str, Any]] = []

    def _endpoint(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._log.seek(0)
            found = re.search(rb"DevTools listening on (ws://\S+)", self._log.read())
            if found:
                return found.group(1).decode()
            if self._proc.poll() is not None:
                break
            time.sleep(0.1)
        self._log.seek(0)
        raise RuntimeError(f"chromium did not start:\n{self._log.read().decode(errors='replace')[-3000:]}")

    async def __aenter__(self) -> Chromium:
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(self._endpoint(), max_msg_size=64 << 20)
        target = await self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
                                   session=False)
        self._session = attached["sessionId"]
        await self.send("Page.enable")
        await self.send("Network.enable")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    async def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True) -> dict[str, Any]:
        assert self._ws is not None
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        await self._ws.send_str(json.dumps(message))
        while True:
            reply = json.loads((await asyncio.wait_for(self._ws.receive(), 30)).data)
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    async def open(self, url: str, headers: dict[str, str] | None = None) -> int:
        """Navigate (with `headers` on every request of the page); the document's HTTP status."""
        await self.send("Network.setExtraHTTPHeaders", {"headers": headers or {}})
        self._events.clear()
        frame = await self.send("Page.navigate", {"url": url})
        if frame.get("errorText"):
            raise RuntimeError(f"{url}: {frame['errorText']}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for event in self._events:
                if event.get("method") == "Network.responseReceived" and event["params"]["type"] == "Document":
                    return int(event["params"]["response"]["status"])
            await self.evaluate("1")  # reads the events that arrived meanwhile
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{url}: no document response")

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                      "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 10) -> Any:
        """Polls `expression` until it is truthy; its value (the last one in the error, if never).
        One that throws counts as not yet: the page may still be parsing (no element to read)."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            try:
                value = await self.evaluate(expression)
            except RuntimeError as exc:
                value = exc
            if value and not isinstance(value, Exception):
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f"after {timeout} s, {expression} is still {value!r}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))
