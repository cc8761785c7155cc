"""Reading a user's YAML or JSON file: a file that does not parse is named with the line, the column and the fix.

``yaml.safe_load(path.read_text())`` reports ``<unicode string>, line 2``; these name the file instead. Torch-free
(the planner and the CLI use them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """``yaml.safe_load`` of the file at ``path``; a syntax error raises ``ValueError`` naming ``what`` and ``path``."""
    import yaml

    text = _text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{what} {str(path)!r} is not valid YAML: {where}{problem}; fix the file") from err


def read_json(path: str | Path, *, what: str = "JSON file") -> Any:
    """``json.loads`` of the file at ``path``; a syntax error raises ``ValueError`` naming ``what`` and ``path``."""
    text = _text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: line {err.lineno}, column {err.colno}: "
                         f"{err.msg}; fix or restore the file") from err


def _text(path: str | Path, what: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r}: no such file")
    try:
        return file.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not text (not UTF-8: {err.reason} at byte {err.start}); give "
                         "the YAML or JSON file itself") from err
