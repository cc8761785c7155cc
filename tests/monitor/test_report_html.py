"""``report.html`` embeds every plot and the summary, and a real headless Chromium renders it.

The browser test is skipped without Chromium (Debian: ``apt-get install -y chromium``); CI does not
install it, so the rest of the suite never depends on apt.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from run_rows import ppo_rows, write_run

from hybridflow.monitor import write_report
from hybridflow.monitor.browser import find_chromium, render_in_browser

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason="no Chromium on PATH (apt-get install -y chromium, or set "
                                           "HYBRIDFLOW_CHROMIUM)")


def test_report_html_embeds_every_plot_and_the_table(tmp_path: Path) -> None:
    files = write_report(write_run(tmp_path / "run", ppo_rows()))
    page = files.html.read_text()
    assert files.html == tmp_path / "run" / "report.html"
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == len(files.plots) == 11  # reward ... memory: every panel the run has data for
    assert [base64.b64decode(image)[:8] for image in images] == [b"\x89PNG\r\n\x1a\n"] * len(images)
    assert "<td>reward/mean</td>" in page and "<td>actor/grad_norm</td>" in page
    assert "moving average (1)" not in page


@needs_chromium
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    files = write_report(write_run(tmp_path / "run", ppo_rows()))
    render = render_in_browser(files.html, screenshot=tmp_path / "shot.png")
    assert render.all_images_loaded, f"{render.images_loaded}/{render.images_total} images rendered"
    assert render.images_total == len(files.plots)
    assert "reward/mean" in render.dom
    assert render.screenshot is not None and render.screenshot.read_bytes()[:4] == b"\x89PNG"
    # The check can fail: a corrupt image is not counted as rendered.
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r'base64,[^"]{40}', "base64,AAAA", files.html.read_text(), count=1))
    assert render_in_browser(broken).images_loaded == render.images_total - 1
