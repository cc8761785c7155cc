"""``hybridflow report RUN_DIR``: summary table of a run's metrics, PNG plots and one ``report.html``."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("report", help="summarise a training run, plot its metrics, write report.html")
    parser.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    parser.add_argument("--plots", default=None, help="folder for the PNG plots (default: RUN_DIR/plots)")
    parser.add_argument("--html", default=None, help="the page with every plot and the table "
                                                     "(default: RUN_DIR/report.html)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridflow.monitor.report import render_table, summarize, write_report

    if args.html is not None and Path(args.html).exists() and not _is_report(Path(args.html)):
        raise ValueError(f"--html {args.html}: exists and is not a hybridflow report; refusing to replace it: "
                         "choose another path")
    print(render_table(summarize(args.run_dir)))
    files = write_report(args.run_dir, plots_dir=args.plots, html_path=args.html)
    for path in files.plots:
        print(f"wrote {path}")
    print(f"wrote {files.html} (open it in a browser)")
    return 0


def _is_report(path: Any) -> bool:
    try:
        return path.is_file() and "<h1>hybridflow report</h1>" in path.read_text(errors="replace")
    except OSError:
        return False
