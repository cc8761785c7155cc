"""``hybridflow graph NAME|file.py:function``: validate an algorithm and render it."""

from __future__ import annotations

import argparse
from typing import Any

from hybridflow.graph import FORMATS, load_graph, render


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("graph", help="validate and render an algorithm's dataflow graph")
    parser.add_argument("algorithm", help="a built-in name (ppo, grpo, ...) or path/to/file.py:function")
    parser.add_argument("--format", choices=FORMATS, default="text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(render(load_graph(args.algorithm), args.format))
    return 0
