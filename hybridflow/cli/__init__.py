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
    parser.add_argument("--debug", action="store_true",
                        help="print the full traceback of a failure (accepted anywhere on the command line)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; an anticipated failure prints one line (exit 2: bad input, 1: the run failed)."""
    from hybridflow.cli.errors import describe

    words = list(sys.argv[1:] if argv is None else argv)
    # `--debug` may come after the subcommand too (`hybridflow train ... --debug`), where users type it.
    debug = "--debug" in words
    parser = build_parser()
    args, extra = parser.parse_known_args([word for word in words if word != "--debug"])
    # argparse gives a positional list one run of words: `train --resume a=1` leaves `a=1` over. Dotted
    # overrides may come anywhere, as users write them; anything else is still an error.
    if extra and hasattr(args, "overrides") and all("=" in word and not word.startswith("-") for word in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code: int = args.run(args)
    except (Exception, KeyboardInterrupt) as err:
        if debug:
            raise
        code, line = describe(err)
        print(f"hybridflow {args.command}: error: {line}", file=sys.stderr)
        return code
    return code
