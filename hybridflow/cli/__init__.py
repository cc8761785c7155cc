"""The ``hybridflow`` command. Each subcommand is a module with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules, imported only when their command runs so `hybridflow plan` never loads torch.
COMMANDS = {
    "graph": "hybridflow.cli.graph",
    "plan": "hybridflow.cli.plan",
    "train": "hybridflow.cli.train",
    "report": "hybridflow.cli.report",
    "calibrate": "hybridflow.cli.calibrate",
    "export": "hybridflow.cli.export",
    "init": "hybridflow.cli.init",
}


def build_parser() -> argparse.ArgumentParser:
    from hybridflow import __version__

    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training as a dataflow graph.")
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except (ValueError, KeyError, FileNotFoundError, TypeError, AttributeError, ImportError) as err:
        print(f"hybridflow {args.command}: error: {err}", file=sys.stderr)
        return 2
    return code
