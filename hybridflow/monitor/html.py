"""``report.html``: one self-contained page with the summary table and every plot as an embedded PNG."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.monitor.report import RunSummary

# Counts the images the browser decoded into ``<body data-images-loaded="n/total">``, so a headless
# browser's DOM dump shows whether the page really rendered (hybridflow.monitor.browser reads it).
_LOADED_SCRIPT = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const ok = images.filter((image) => image.complete && image.naturalWidth > 0).length;
  document.body.dataset.imagesLoaded = ok + "/" + images.length;
});
</script>"""

_STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }
table { border-collapse: collapse; font-size: 0.85rem; margin-bottom: 1.5rem; }
th, td { padding: 0.2rem 0.6rem; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.plots { display: flex; flex-wrap: wrap; gap: 1rem; }
figure { margin: 0; } figcaption { font-size: 0.8rem; color: #555; }
</style>"""


def render_report_html(summary: RunSummary, plots: Sequence[Path]) -> str:
    """The page as a string: title, summary table, then each PNG in ``plots`` inlined as base64."""
    rows = "\n".join(
        f"<tr><td>{html.escape(m.name)}</td>"
        + "".join(f"<td>{value:.4g}</td>" for value in (m.first, m.last, m.mean, m.minimum, m.maximum)) + "</tr>"
        for m in summary.metrics)
    figures = "\n".join(
        f'<figure><img alt="{html.escape(path.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode("ascii")}">'
        f"<figcaption>{html.escape(path.name)}</figcaption></figure>" for path in plots)
    title = html.escape(f"{summary.run_dir} ({summary.steps} steps)")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>hybridflow report: {title}</title>{_STYLE}</head>
<body>
<h1>hybridflow report</h1>
<p>{title}</p>
<h2>Plots</h2>
<div class="plots">
{figures}
</div>
<h2>Summary</h2>
<table>
<thead><tr><th>metric</th><th>first</th><th>last</th><th>mean</th><th>min</th><th>max</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
{_LOADED_SCRIPT}
</body></html>
"""


def write_report_html(summary: RunSummary, plots: Sequence[Path], out: Path) -> Path:
    """Write :func:`render_report_html` to ``out``; returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report_html(summary, plots), encoding="utf-8")
    return out
