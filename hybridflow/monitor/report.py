"""``hybridflow report RUN_DIR``: a summary table of a run's metrics, PNG plots and ``report.html``."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridflow.monitor.html import write_report_html
from hybridflow.planner.metrics_file import metrics_rows

# Metric families in the order a reader scans them; anything else is listed after these.
HEADLINE = ("reward/mean", "reward/std", "kl", "response_length/mean", "time/step", "throughput/tokens_per_s",
            "memory/rss_gb", "reward_cache/hit_rate")
# Weight refreshes of every policy (``actor/weight_sync/seconds``...) and the plan's estimate follow them.
SYNC = ("weight_sync/seconds", "weight_sync/planned_seconds", "weight_sync/bytes", "weight_sync/planned_bytes")


@dataclass(frozen=True, kw_only=True)
class MetricStats:
    name: str
    first: float
    last: float
    mean: float
    minimum: float
    maximum: float


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Per-metric statistics over a run's steps."""

    run_dir: Path
    steps: int
    metrics: tuple[MetricStats, ...]

    def get(self, name: str) -> MetricStats:
        for stats in self.metrics:
            if stats.name == name:
                return stats
        raise KeyError(f"metric {name!r} is not in {self.run_dir}; it has {[m.name for m in self.metrics]}")


def load_run(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of ``RUN_DIR/metrics.jsonl``, with an error that says what is missing."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the output_dir of a `hybridflow train` run")
    rows = read_metrics_file(path)
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    return rows


def read_metrics_file(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics.jsonl, read by the planner's reader (:mod:`hybridflow.planner.metrics_file`): a torn
    last line is skipped with a warning; a binary file or an earlier line that is not a JSON object is refused,
    naming the file and line."""
    return [row for _, row in metrics_rows(path)]


def summarize(run_dir: str | Path) -> RunSummary:
    rows = load_run(run_dir)
    names = sorted({key for row in rows for key in row if key != "step"}, key=_order)
    stats = []
    for name in names:
        values = [float(row[name]) for row in rows if isinstance(row.get(name), int | float)]
        finite = [value for value in values if math.isfinite(value)]
        if not finite:
            continue
        stats.append(MetricStats(name=name, first=finite[0], last=finite[-1], mean=sum(finite) / len(finite),
                                 minimum=min(finite), maximum=max(finite)))
    return RunSummary(run_dir=Path(run_dir), steps=len(rows), metrics=tuple(stats))


def _order(name: str) -> tuple[int, str]:
    if name in HEADLINE:
        return HEADLINE.index(name), name
    sync = [i for i, suffix in enumerate(SYNC) if name.endswith(suffix)]
    return (len(HEADLINE) + sync[0], name) if sync else (len(HEADLINE) + len(SYNC), name)


def render_table(summary: RunSummary) -> str:
    """The summary as a rich table rendered to text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary.run_dir} ({summary.steps} steps)")
    for column in ("metric", "first", "last", "mean", "min", "max"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for m in summary.metrics:
        table.add_row(m.name, *(f"{value:.4g}" for value in (m.first, m.last, m.mean, m.minimum, m.maximum)))
    console = Console(width=110, record=True)
    with console.capture() as capture:
        console.print(table)
    return capture.get()


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """PNG plots of every panel the run has data for (see :mod:`hybridflow.monitor.panels`) and of its median
    step's timeline; the files written."""
    from hybridflow.monitor.panels import choose_panels, choose_timeline
    from hybridflow.monitor.plots import draw_panels, draw_timeline

    target = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    rows = load_run(run_dir)
    written = draw_panels(choose_panels(rows), target)
    timeline = choose_timeline(rows, planned_spans(Path(run_dir)))
    if timeline is not None:
        written.append(draw_timeline(timeline, target))
    return written


def planned_spans(run_dir: Path) -> dict[str, tuple[float, float]]:
    """Each node's span in the run's plan (``plan.json``'s node estimates: ``start_s``, ``end_s``); {} without one,
    or with a warning naming the file when it cannot be read (the timeline then shows what ran alone)."""
    from hybridflow.planner.plan import Plan

    path = run_dir / "plan.json"
    if not path.is_file():
        return {}
    try:
        nodes = Plan.from_json(path.read_text()).nodes
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        print(f"hybridflow: warning: {path} is not a readable plan ({type(error).__name__}: {error}); the timeline "
              "shows the measured spans alone", file=sys.stderr)
        return {}
    return {node.node: (node.start_s, node.end_s) for node in nodes}


@dataclass(frozen=True, kw_only=True)
class ReportFiles:
    """What ``hybridflow report`` wrote: the PNGs and the page that embeds them with the summary."""

    plots: tuple[Path, ...]
    html: Path


def write_report(run_dir: str | Path, *, plots_dir: str | Path | None = None,
                 html_path: str | Path | None = None) -> ReportFiles:
    """Plots (default ``RUN_DIR/plots``) and ``report.html`` (default ``RUN_DIR/report.html``) for a run."""
    plots = plot_run(run_dir, plots_dir)
    page = write_report_html(summarize(run_dir), plots, Path(html_path) if html_path else Path(run_dir) / "report.html")
    return ReportFiles(plots=tuple(plots), html=page)
