"""Open a report in a real headless Chromium and read back what rendered (for tests and CI-free checks).

    python -m hybridflow.monitor.browser RUN_DIR/report.html [--screenshot out.png]

Chromium is not a Python dependency: on Debian ``apt-get install -y chromium``. ``HYBRIDFLOW_CHROMIUM``
names another binary. Everything runs offline (no network, no first-run or component updates).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_LOADED = re.compile(r'data-images-loaded="(\d+)/(\d+)"')


@dataclass(frozen=True, kw_only=True)
class BrowserRender:
    """The DOM after load and the images the browser decoded (``images_loaded`` of ``images_total``)."""

    dom: str
    images_loaded: int
    images_total: int
    screenshot: Path | None = None

    @property
    def all_images_loaded(self) -> bool:
        return self.images_total > 0 and self.images_loaded == self.images_total


def find_chromium() -> str | None:
    """The Chromium binary to use: ``$HYBRIDFLOW_CHROMIUM``, else the first of :data:`CANDIDATES` on PATH."""
    chosen = os.environ.get("HYBRIDFLOW_CHROMIUM")
    if chosen:
        return chosen
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


def render_in_browser(page: Path, *, screenshot: Path | None = None, browser: str | None = None,
                      timeout: float = 120.0) -> BrowserRender:
    """Load ``page`` in headless Chromium; its DOM dump, the image count it reports and, if asked, a screenshot.

    The count comes from the script :mod:`hybridflow.monitor.html` puts in ``report.html``; a page
    without it reports 0 of 0.
    """
    binary = browser or find_chromium()
    if binary is None:
        raise FileNotFoundError("no Chromium found: install it (Debian: apt-get install -y chromium) or set "
                                "HYBRIDFLOW_CHROMIUM to its path")
    url = page.resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="hybridflow-chromium-") as profile:
        base = [binary, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000"]
        dom = _run([*base, "--dump-dom", url], timeout).stdout
        if screenshot is not None:
            _run([*base, f"--screenshot={screenshot.resolve()}", "--window-size=1280,2400", url], timeout)
    found = _LOADED.search(dom)
    loaded, total = (int(found[1]), int(found[2])) if found else (0, 0)
    return BrowserRender(dom=dom, images_loaded=loaded, images_total=total, screenshot=screenshot)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} exited with {result.returncode}: {result.stderr[-2000:]}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="open a hybridflow report.html in headless Chromium")
    parser.add_argument("page", type=Path)
    parser.add_argument("--screenshot", type=Path, default=None)
    args = parser.parse_args(argv)
    render = render_in_browser(args.page, screenshot=args.screenshot)
    print(f"{args.page}: {render.images_loaded}/{render.images_total} images rendered")
    return 0 if render.all_images_loaded else 1


if __name__ == "__main__":
    raise SystemExit(main())
