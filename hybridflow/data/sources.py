"""Reading rows from a jsonl file, a parquet file or a local HF ``datasets`` directory, with row locations.

Every row keeps where it came from (file and 1-based line for jsonl, row for parquet and datasets),
so an error about a bad row names the place to fix. Nothing here reaches the network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]
SUFFIXES = (".jsonl", ".parquet")


class MissingColumnError(KeyError):
    """A row lacks a configured column; the message names the row, the key, the columns present and the fix."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


class DataFileError(ValueError):
    """A data file that cannot be read as rows (bad JSON, empty, unknown format)."""


@dataclass(frozen=True, kw_only=True)
class RowTable:
    """The rows of one data source and, per row, where it is (``line`` for jsonl, else the 1-based row)."""

    source: str
    rows: list[Row]
    lines: list[int]
    unit: str  # "line" or "row"

    def where(self, index: int) -> str:
        return f"{self.source} {self.unit} {self.lines[index]}"


def read_table(path: str | Path, *, split: str = "train", field: str = "path") -> RowTable:
    """Rows of ``path``: a ``.jsonl`` / ``.parquet`` file or a directory written by ``datasets.save_to_disk``.

    ``split`` picks the split of a ``DatasetDict`` directory; ``field`` is the config key named in errors.
    """
    path = Path(path)
    if path.is_dir():
        table = _read_datasets_dir(path, split, field)
    elif not path.is_file():
        raise FileNotFoundError(f"{field}: no file or directory {path}")
    elif path.suffix == ".jsonl":
        table = _read_jsonl(path)
    elif path.suffix == ".parquet":
        table = _read_parquet(path)
    else:
        raise DataFileError(f"{field} {path}: use a .jsonl or .parquet file, or a directory written by "
                            "datasets' save_to_disk")
    if not table.rows:
        raise DataFileError(f"{field} {table.source} has no rows (an empty data file); it needs at least one row")
    return table


def _read_jsonl(path: Path) -> RowTable:
    rows, lines = [], []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(f"{path} line {number}: not valid JSON ({err.msg} at column {err.colno})") from err
            if not isinstance(row, dict):
                raise DataFileError(f"{path} line {number}: a JSON {type(row).__name__}, not an object of columns")
            rows.append(row)
            lines.append(number)
    return RowTable(source=str(path), rows=rows, lines=lines, unit="line")


def _read_parquet(path: Path) -> RowTable:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return RowTable(source=str(path), rows=rows, lines=list(range(1, len(rows) + 1)), unit="row")


def _read_datasets_dir(path: Path, split: str, field: str) -> RowTable:
    if not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():
        raise DataFileError(f"{field} {path} is a directory but not one written by datasets' save_to_disk (no "
                            "dataset_dict.json or state.json); point it at a .jsonl or .parquet file instead")
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"{field} {path} is a HF datasets directory: install the 'datasets' package "
                          "(pip install datasets) to read it, or export it to parquet") from err
    loaded = datasets.load_from_disk(str(path))
    source = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise KeyError(f"{field} {path} has no split {split!r}; its splits are {sorted(loaded)}")
        loaded, source = loaded[split], f"{path} (split {split})"
    rows = loaded.to_list()
    return RowTable(source=source, rows=rows, lines=list(range(1, len(rows) + 1)), unit="row")


def lookup(row: Mapping[str, Any], key: str, *, where: str, field: str) -> Any:
    """``row[key]``, where a dotted key (``reward_model.ground_truth``) walks into nested columns.

    A column whose own name contains the dot wins over the nested path. ``field`` is the config key
    that chose ``key``, named in the error with the columns present.
    """
    if key in row:
        return row[key]
    value: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            inside = f"; column {'.'.join(walked)!r} has keys {sorted(value)}" if walked and isinstance(
                value, Mapping) else ""
            raise MissingColumnError(f"{where}: no {key!r} column ({field}){inside}; columns present: {sorted(row)}. "
                                     f"Set {field} to the column that holds it (dotted keys reach nested columns)")
        value = value[part]
        walked.append(part)
    return value


def has_key(row: Mapping[str, Any], key: str) -> bool:
    """Whether :func:`lookup` would find ``key`` in ``row``."""
    if key in row:
        return True
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False
        value = value[part]
    return True
