"""Drawing the panels of :mod:`hybridflow.monitor.panels` as PNG files (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.monitor.panels import Panel, Series, Timeline

# A rolling mean helps only on long, noisy runs; on short ones it hides the few points there are.
MIN_STEPS_FOR_ROLLING_MEAN = 20


def draw_panels(panels: Sequence[Panel], out_dir: Path, *, dpi: int = 90) -> list[Path]:
    """One PNG per panel in ``out_dir``; returns the files written."""
    return [_saved(panel_figure(panel), out_dir / panel.filename, dpi) for panel in panels]


def draw_timeline(timeline: Timeline, out_dir: Path, *, dpi: int = 90) -> Path:
    """``timeline.png`` in ``out_dir``: one bar per node from its first call's start to its last call's end,
    labelled with the seconds its calls ran (a bar longer than that waited between calls)."""
    return _saved(timeline_figure(timeline), out_dir / timeline.filename, dpi)


def _saved(figure: Any, path: Path, dpi: int) -> Path:
    """``figure`` written to ``path`` (its folder made) and closed."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def timeline_figure(timeline: Timeline) -> Any:
    """The matplotlib figure of a step's timeline (the caller closes it): nodes top to bottom in start order, each
    measured span above the plan's (hatched) where the run has a plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = timeline.bars
    planned = any(bar.planned is not None for bar in bars)
    figure, axis = plt.subplots(figsize=(8.2, 0.9 + (0.5 if planned else 0.35) * len(bars)))
    shift = 0.17 if planned else 0.0  # measured above, planned below, in each node's row
    labels = {"measured", "planned"}  # each labelled once, for the legend
    for row, bar in enumerate(bars):
        axis.barh(row - shift, max(bar.end - bar.start, 0.0), left=bar.start, height=0.6 - 2 * shift,
                  color="tab:blue", alpha=0.75, label=_once(labels, "measured"))
        busy = "" if bar.busy != bar.busy else f"{bar.busy:.3g} s"  # NaN: the run recorded no seconds
        axis.annotate(busy, (bar.end, row - shift), xytext=(3, 0), textcoords="offset points", va="center",
                      fontsize="small")
        if bar.planned is not None:
            start, end = bar.planned
            axis.barh(row + shift, max(end - start, 0.0), left=start, height=2 * shift, facecolor="none",
                      edgecolor="tab:orange", hatch="//", label=_once(labels, "planned"))
    axis.set_yticks(range(len(bars)), [bar.node for bar in bars])
    axis.invert_yaxis()  # the first node on top
    ends = [bar.end for bar in bars] + [bar.planned[1] for bar in bars if bar.planned is not None]
    axis.set_xlim(0.0, 1.12 * max([timeline.step_seconds, *ends]))
    if planned:
        axis.legend(fontsize="small", loc="upper right")  # the step starts at the top left
    axis.set_xlabel("seconds from the step's start (labels: the seconds each node's calls ran)")
    axis.set_title(timeline.title)
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    return figure


def _once(left: set[str], label: str) -> str | None:
    """``label`` the first time it is asked for (taken out of ``left``), None after: one legend entry each."""
    if label in left:
        left.discard(label)
        return label
    return None


def panel_figure(panel: Panel) -> Any:
    """The matplotlib figure of one panel (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    crowded = len(panel.series) > 4  # many lines: the legend goes beside the plot, not over the data
    figure, axis = plt.subplots(figsize=(8.2 if crowded else 6.4, 3.6))
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for line in panel.series:
        axis.plot(line.steps, line.values, label=line.label, marker="." if len(line.values) < 30 else None)
    if panel.band is not None:
        _draw_band(axis, panel.series[0], panel.band)
    if panel.smooth:
        _draw_rolling_mean(axis, panel.series[0])
    _set_scale(axis, panel)
    axis.set_xlabel("step")
    axis.set_ylabel(panel.ylabel)
    axis.set_title(panel.title)
    axis.grid(alpha=0.3)
    if crowded:
        axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def _draw_band(axis: Any, mean: Series, spread: Series) -> None:
    by_step = dict(zip(spread.steps, spread.values, strict=True))
    points = [(s, m, by_step[s]) for s, m in zip(mean.steps, mean.values, strict=True) if s in by_step]
    if points:
        axis.fill_between([p[0] for p in points], [p[1] - p[2] for p in points], [p[1] + p[2] for p in points],
                          alpha=0.2, label=spread.label)


def _draw_rolling_mean(axis: Any, line: Series) -> None:
    if len(line.values) < MIN_STEPS_FOR_ROLLING_MEAN:
        return
    window = max(2, len(line.values) // 10)
    smooth = [sum(line.values[i - window + 1:i + 1]) / window for i in range(window - 1, len(line.values))]
    axis.plot(line.steps[window - 1:], smooth, linewidth=2, label=f"rolling mean over {window} steps")


def _set_scale(axis: Any, panel: Panel) -> None:
    values = [v for line in panel.series for v in line.values]
    top = max(values)
    if panel.scale == "log" and min(values) > 0:
        axis.set_yscale("log")  # nodes differ by orders of magnitude (a reward function vs a generation)
    elif panel.scale == "from_zero":
        # Autoscaling a near-constant series (memory) magnifies noise into mountains: start at zero.
        axis.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    elif panel.scale == "fraction":
        axis.set_ylim(0, max(1.0, top) * 1.05 if top > 0.5 else max(top * 1.3, 0.05))
    elif panel.scale == "percent":
        axis.set_ylim(0, 105)
