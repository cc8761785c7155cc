"""Reading a run back: summary tables, plots and ``report.html`` from ``metrics.jsonl`` (no torch needed)."""

from hybridflow.monitor.report import ReportFiles, RunSummary, load_run, plot_run, summarize, write_report

__all__ = ["ReportFiles", "RunSummary", "load_run", "plot_run", "summarize", "write_report"]
