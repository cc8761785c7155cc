"""``hybridflow report RUN_DIR``: summary table of a run's metrics, and PNG plots beside them."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("report", help="summarise a training run and plot its metrics")
    parser.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    parser.add_argument("--plots", default=None, help="folder for the PNG plots (default: RUN_DIR/plots)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridflow.monitor.report import plot_run, render_table, summarize

    print(render_table(summarize(args.run_dir)))
    for path in plot_run(args.run_dir, args.plots):
        print(f"wrote {path}")
    return 0
