"""A run's ``metrics.jsonl`` read for the planner (``--lengths-from``, ``--agent-from``, ``calibrate --run``).

The same rules as ``hybridflow report``: a torn last line (a crash mid-write leaves one) is skipped with a
warning, a file that is binary, an earlier line that is not a JSON object, or a metric that is not a
number is refused, naming the file and the line. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

FIX = "pass a `hybridflow train` run's metrics.jsonl (a JSON object a line), or restore the file"


def metrics_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """Each row of ``path`` with its line number (see the module docstring)."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as err:
        raise ValueError(f"{file} cannot be read ({err.strerror or err}); {FIX}") from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not a metrics.jsonl (binary data at byte {err.start}, not UTF-8 text); "
                         f"{FIX}") from err
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    rows: list[tuple[int, dict[str, Any]]] = []
    for position, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError as err:
            if position == len(lines) - 1 and rows:
                print(f"hybridflow: warning: {file} line {number} is torn (an interrupted write); skipped it",
                      file=sys.stderr)
                break
            raise ValueError(f"{file} line {number} is not JSON ({err}); {FIX}") from err
        if not isinstance(row, dict):
            raise ValueError(f"{file} line {number} is a {type(row).__name__}, not a JSON object of metrics; {FIX}")
        rows.append((number, row))
    return rows


def metric(path: str | Path, number: int, row: dict[str, Any], key: str) -> float | None:
    """``row[key]`` as a finite float (None when absent); anything else is refused naming the file, line and key."""
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{path} line {number}: {key!r} is {value!r}, not a finite number; {FIX}")
    return float(value)
