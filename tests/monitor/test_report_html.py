"""``report.html`` embeds every plot and the summary, and a real headless Chromium renders it.

``make test`` installs Chromium where it is missing (Debian's package, as root); elsewhere the browser test
skips and says how to install it. The browser test's screenshot is kept at ``artifacts/report.png`` (or under
``$HYBRIDFLOW_ARTIFACTS``), which ``.ci/run`` names in its log.
"""

from __future__ import annotations

import base64
import io
import os
import re
from pathlib import Path

import pytest
from run_rows import ppo_rows, write_run

from hybridflow.monitor import write_report
from hybridflow.monitor.browser import find_chromium, render_in_browser

ARTIFACTS = Path(os.environ.get("HYBRIDFLOW_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts"))
needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason="no Chromium on PATH: `make chromium` installs Debian's package as root "
                                           "(apt-get install -y chromium), or set HYBRIDFLOW_CHROMIUM to a binary")


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
def test_report_renders_in_headless_chromium_with_data_in_every_panel(tmp_path: Path) -> None:
    files = write_report(write_run(tmp_path / "run", ppo_rows()))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    render = render_in_browser(files.html, screenshot=ARTIFACTS / "report.png")
    assert render.all_images_loaded, f"{render.images_loaded}/{render.images_total} images rendered"
    assert [panel.name for panel in render.panels] == [plot.stem for plot in files.plots]
    assert [panel.name for panel in render.panels if not panel.has_data] == []
    assert render.console_errors == ()
    assert "reward/mean" in render.dom and 'data-images-loaded="11/11"' in render.dom
    assert render.screenshot is not None and render.screenshot.read_bytes()[:4] == b"\x89PNG"
    print(f"report screenshot: {render.screenshot}")


@needs_chromium
def test_the_browser_check_sees_a_broken_image_an_empty_panel_and_a_console_error(tmp_path: Path) -> None:
    from PIL import Image

    files = write_report(write_run(tmp_path / "run", ppo_rows()))
    page = files.html.read_text()
    blank = io.BytesIO()
    Image.new("RGB", (64, 48), (250, 250, 250)).save(blank, format="PNG")  # axes without a line: greys only
    images = re.findall(r'base64,([^"]+)"', page)
    page = page.replace(images[0], "AAAA").replace(images[1], base64.b64encode(blank.getvalue()).decode())
    page = page.replace("</body>", "<script>console.error('panel failed'); missing_function();</script></body>")
    broken = tmp_path / "broken.html"
    broken.write_text(page)
    render = render_in_browser(broken)
    assert render.images_loaded == render.images_total - 1
    assert [panel.name for panel in render.panels if not panel.has_data] == [files.plots[0].stem, files.plots[1].stem]
    assert render.console_errors[0] == "console.error: panel failed"
    assert "missing_function is not defined" in render.console_errors[1]
