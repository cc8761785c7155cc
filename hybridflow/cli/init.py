"""``hybridflow init [PATH] [--template NAME]``: write a starter config (one of the shipped ``configs/``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_TEMPLATE = "grpo_reverse"  # runs anywhere: a built-in task, no data files


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("init", help="write a starter training config to edit")
    parser.add_argument("path", nargs="?", default="hybridflow.yaml", help="where to write it (default: "
                                                                           "hybridflow.yaml)")
    parser.add_argument("--template", default=DEFAULT_TEMPLATE,
                        help=f"a shipped config (default: {DEFAULT_TEMPLATE}); --list shows them")
    parser.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.set_defaults(run=run)


def templates() -> dict[str, str]:
    """Shipped config name -> YAML text: the installed ``hybridflow.configs`` package, else a checkout's
    ``configs/`` folder (a source tree maps only backends and algorithms into the package)."""
    import importlib.util

    if importlib.util.find_spec("hybridflow.configs") is not None:
        from importlib.resources import files

        root: Any = files("hybridflow.configs")
    else:
        import hybridflow

        root = Path(hybridflow.__file__).resolve().parents[1] / "configs"
    return {item.name.removesuffix(".yaml"): item.read_text() for item in root.iterdir()
            if item.name.endswith(".yaml")}


def run(args: argparse.Namespace) -> int:
    from hybridflow.train.config import load_config

    found = templates()
    if args.list:
        for name, text in sorted(found.items()):
            print(f"{name:24s} {text.splitlines()[0].lstrip('# ')}")
        return 0
    if args.template not in found:
        raise KeyError(f"--template {args.template!r} is not a shipped config; choose one of {sorted(found)}")
    out = Path(args.path)
    if out.exists() and not args.force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it or give another path")
    out.write_text(found[args.template])
    load_config(out)  # what we write must load
    print(f"wrote {out} (from {args.template}); run it with: hybridflow train --config {out}")
    return 0
