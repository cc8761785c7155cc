"""Reading a run back: summary tables and plots from ``metrics.jsonl`` (no torch needed)."""

from hybridflow.monitor.report import RunSummary, load_run, plot_run, summarize

__all__ = ["RunSummary", "load_run", "plot_run", "summarize"]
