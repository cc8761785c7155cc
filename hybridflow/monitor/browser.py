"""Open a report in a real headless Chromium and read back what rendered (for tests, CI and users).

    python -m hybridflow.monitor.browser RUN_DIR/report.html [--screenshot out.png]

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages, each
ended by a NUL byte, in on fd 3 and out on fd 4), so no port is opened and no client library is needed. The
page is loaded, its images are waited for, every console error and uncaught exception is collected, each plot
is drawn onto a canvas to count the pixels its data lines coloured, and a full-page screenshot is taken.

Chromium is not a Python dependency: on Debian ``apt-get install -y chromium``. ``HYBRIDFLOW_CHROMIUM``
names another binary. Everything runs offline (no network, no first-run or component updates).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
WINDOW = (1280, 1024)

# Per image of the page: its size and how many of its pixels are coloured (not a grey: axes, ticks and text
# are drawn in greys, data lines and bands in colours), so a panel drawn without data counts ~0.
_PANELS_SCRIPT = """JSON.stringify([...document.images].map((image) => {
  const canvas = document.createElement("canvas");
  canvas.width = image.naturalWidth; canvas.height = image.naturalHeight;
  let coloured = 0;
  if (image.naturalWidth > 0) {
    const context = canvas.getContext("2d");
    context.drawImage(image, 0, 0);
    const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
    for (let i = 0; i < pixels.length; i += 4) {
      const [r, g, b] = [pixels[i], pixels[i + 1], pixels[i + 2]];
      if (Math.max(r, g, b) - Math.min(r, g, b) > 40) coloured += 1;
    }
  }
  return {name: image.alt, width: image.naturalWidth, height: image.naturalHeight, coloured: coloured};
}))"""


@dataclass(frozen=True, kw_only=True)
class PanelRender:
    """One ``<img>`` as the browser decoded it: its size and the pixels its data coloured."""

    name: str
    width: int
    height: int
    coloured: int

    @property
    def has_data(self) -> bool:
        return self.width > 0 and self.coloured > 0


@dataclass(frozen=True, kw_only=True)
class BrowserRender:
    """The DOM after load, the images the browser decoded, the console errors and, if asked, a screenshot."""

    dom: str
    panels: tuple[PanelRender, ...]
    console_errors: tuple[str, ...]
    screenshot: Path | None = None

    @property
    def images_total(self) -> int:
        return len(self.panels)

    @property
    def images_loaded(self) -> int:
        return sum(panel.width > 0 for panel in self.panels)

    @property
    def all_images_loaded(self) -> bool:
        return self.images_total > 0 and self.images_loaded == self.images_total


class BrowserError(RuntimeError):
    """Chromium could not load the page, or stopped answering."""


def find_chromium() -> str | None:
    """The Chromium binary to use: ``$HYBRIDFLOW_CHROMIUM``, else the first of :data:`CANDIDATES` on PATH."""
    chosen = os.environ.get("HYBRIDFLOW_CHROMIUM")
    if chosen:
        return chosen
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


def render_in_browser(page: Path, *, screenshot: Path | None = None, browser: str | None = None,
                      timeout: float = 120.0) -> BrowserRender:
    """Load ``page`` in headless Chromium and report what rendered (see :class:`BrowserRender`)."""
    binary = browser or find_chromium()
    if binary is None:
        raise FileNotFoundError("no Chromium found: install it (Debian: apt-get install -y chromium) or set "
                                "HYBRIDFLOW_CHROMIUM to its path")
    with tempfile.TemporaryDirectory(prefix="hybridflow-chromium-") as profile, \
            _DevTools(binary, profile, deadline=time.monotonic() + timeout) as tools:
        session = tools.open_page()
        tools.call("Emulation.setDeviceMetricsOverride", session=session, width=WINDOW[0], height=WINDOW[1],
                   deviceScaleFactor=1, mobile=False)
        tools.forget_events()  # about:blank's own load is not the page's
        tools.call("Page.navigate", session=session, url=page.resolve().as_uri())
        tools.wait_for("Page.loadEventFired", session)
        panels = json.loads(tools.evaluate(session, _PANELS_SCRIPT))
        dom = tools.evaluate(session, "document.documentElement.outerHTML")
        if screenshot is not None:
            shot = tools.call("Page.captureScreenshot", session=session, format="png", captureBeyondViewport=True)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        errors = tuple(tools.errors)
    return BrowserRender(dom=dom, panels=tuple(PanelRender(**panel) for panel in panels), console_errors=errors,
                         screenshot=screenshot)


class _DevTools:
    """A Chromium process and its DevTools pipe: numbered calls, their answers, and the events seen."""

    def __init__(self, binary: str, profile: str, *, deadline: float) -> None:
        self.deadline = deadline
        self.errors: list[str] = []
        self._events: list[dict[str, Any]] = []
        self._next_id = 0
        self._buffer = b""
        to_browser, self._send = os.pipe()
        self._receive, from_browser = os.pipe()
        high_in, high_out = os.dup(to_browser), os.dup(from_browser)  # above 4, so the dup2s below cannot clash

        def wire() -> None:
            os.dup2(high_in, 3)
            os.dup2(high_out, 4)

        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in __exit__; a pipe could fill and stall it)
        self.process = subprocess.Popen([binary, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}",
                                         f"--window-size={WINDOW[0]},{WINDOW[1]}", "about:blank"],
                                        close_fds=False, preexec_fn=wire,  # 3, 4 inherited; the rest close on exec
                                        stdout=subprocess.DEVNULL, stderr=self._stderr)
        for fd in (to_browser, from_browser, high_in, high_out):
            os.close(fd)

    def __enter__(self) -> _DevTools:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._write({"id": -1, "method": "Browser.close"})
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._send)
        os.close(self._receive)
        self._stderr.close()

    def open_page(self) -> str:
        """A new tab, attached with a flat session; its runtime, log and page domains report events."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session: str = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=session)
        return session

    def evaluate(self, session: str, expression: str) -> Any:
        answer = self.call("Runtime.evaluate", session=session, expression=expression, returnByValue=True)
        if "exceptionDetails" in answer:
            raise BrowserError(f"evaluating in the page failed: {answer['exceptionDetails'].get('text')}")
        return answer["result"].get("value")

    def call(self, method: str, *, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        self._write(message)
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self._note(reply)

    def forget_events(self) -> None:
        self._events.clear()

    def wait_for(self, event: str, session: str) -> None:
        while not any(seen["method"] == event and seen.get("sessionId") == session for seen in self._events):
            self._note(self._read())

    def _note(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method is None:
            return
        self._events.append(message)
        if method == "Runtime.consoleAPICalled" and params.get("type") in {"error", "assert"}:
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')}")

    def _write(self, message: dict[str, Any]) -> None:
        os.write(self._send, json.dumps(message).encode() + b"\0")

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([self._receive], [], [], max(left, 0))
            chunk = os.read(self._receive, 1 << 20) if ready else b""
            if not chunk:
                self._stderr.seek(0)
                stderr = self._stderr.read().decode(errors="replace")[-1500:]
                raise BrowserError(("Chromium timed out" if not ready else f"Chromium exited ({self.process.poll()})")
                                   + f"; its last output: {stderr}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="open a hybridflow report.html in headless Chromium")
    parser.add_argument("page", type=Path)
    parser.add_argument("--screenshot", type=Path, default=None)
    args = parser.parse_args(argv)
    render = render_in_browser(args.page, screenshot=args.screenshot)
    empty = [panel.name for panel in render.panels if not panel.has_data]
    print(f"{args.page}: {render.images_loaded}/{render.images_total} images rendered, panels without data: "
          f"{empty or 'none'}, console errors: {list(render.console_errors) or 'none'}")
    return 0 if render.all_images_loaded and not empty and not render.console_errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
