"""``hybridflow init [PATH] [--template NAME]``: write a starter config (one of the shipped ``configs/``) and the
data files it names (``configs/data/``, package data of ``hybridflow.configs``) next to it."""

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
    parser.add_argument("--force", action="store_true", help="overwrite existing files (the config, a template's data)")
    parser.set_defaults(run=run)


SHIPPED_PREFIX = "configs/"  # a template's paths are a clone's root relative; the package holds configs/'s files


def _root() -> Any:
    """The shipped configs' folder: the installed ``hybridflow.configs`` package (a Traversable), else a
    checkout's ``configs/`` (a source tree maps only backends and algorithms into the package)."""
    import importlib.util

    if importlib.util.find_spec("hybridflow.configs") is not None:
        from importlib.resources import files

        return files("hybridflow.configs")
    import hybridflow

    return Path(hybridflow.__file__).resolve().parents[1] / "configs"


def templates(root: Any = None) -> dict[str, str]:
    """Shipped config name -> YAML text, from ``root`` (default :func:`_root`)."""
    root = _root() if root is None else root
    return {item.name.removesuffix(".yaml"): item.read_text() for item in root.iterdir()
            if item.name.endswith(".yaml")}


def template_data(text: str) -> list[str]:
    """The files a template's ``data.path`` / ``data.val_path`` name under ``configs/`` (shipped with it, as
    ``hybridflow.configs`` package data): the ones ``init`` copies next to the config it writes."""
    import yaml

    section = (yaml.safe_load(text) or {}).get("data") or {}
    found = []
    for key in ("path", "val_path"):
        value = section.get(key)
        for entry in value if isinstance(value, list) else [value]:
            if isinstance(entry, str) and entry.startswith(SHIPPED_PREFIX):
                found.append(entry)
    return found


def write_template(name: str, out: Path, *, force: bool = False, root: Any = None) -> list[Path]:
    """Write template ``name`` to ``out`` and its data files under ``out``'s folder (``configs/data/x`` ->
    ``<out dir>/data/x``), the config's data paths pointing at those copies (absolute: the config runs from any
    directory). Nothing is overwritten without ``force``, an identical data file is kept. Returns the data files."""
    import json

    root = _root() if root is None else root
    found = templates(root)
    if name not in found:
        raise KeyError(f"--template {name!r} is not a shipped config; choose one of {sorted(found)}")
    text = found[name]
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it or give another path")
    base = out.resolve().parent
    copies: list[tuple[str, Any, Path]] = []
    for entry in template_data(text):
        parts = Path(entry).relative_to(SHIPPED_PREFIX).parts
        source = root.joinpath(*parts)
        if not source.is_file():
            raise FileNotFoundError(f"template {name!r}: data file {entry} is not shipped with hybridflow.configs "
                                    "(the package data in pyproject.toml must list it)")
        copies.append((entry, source, base.joinpath(*parts)))
    for _, source, dest in copies:  # every refusal before anything is written
        if dest.exists() and not force and dest.read_bytes() != source.read_bytes():
            raise FileExistsError(f"{dest} exists and differs from template {name!r}'s data; pass --force to "
                                  "overwrite it, or write the config into another folder")
    for entry, source, dest in copies:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(source.read_bytes())
        text = text.replace(entry, json.dumps(str(dest)))  # a JSON string is a YAML double-quoted scalar
    text = text.replace(f"--config configs/{name}.yaml", f"--config {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return [dest for _, _, dest in copies]


def run(args: argparse.Namespace) -> int:
    from hybridflow.train.config import load_config

    if args.list:
        for name, text in sorted(templates().items()):
            print(f"{name:24s} {text.splitlines()[0].lstrip('# ')}")
        return 0
    out = Path(args.path)
    data = write_template(args.template, out, force=args.force)
    config = load_config(out)  # what we write must load, its data paths the copies
    named = [p for v in (config.data.path, config.data.val_path) for p in (v if isinstance(v, list) else [v]) if p]
    if not {str(p) for p in data} <= set(named):
        raise RuntimeError(f"{out}: its data paths {named} are not the copies written, {[str(p) for p in data]}")
    for path in data:
        print(f"wrote {path}")
    print(f"wrote {out} (from {args.template}); run it with: hybridflow train --config {out}")
    return 0
