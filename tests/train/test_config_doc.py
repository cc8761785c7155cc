"""docs/configuration.md's key table and the schema agree: every key is in the table, every key it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from hybridflow.train.config import TrainConfig
from hybridflow.train.config_keys import all_keys, walk

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _rows() -> list[list[str]]:
    lines = DOC.read_text().splitlines()
    start = lines.index("| key | default | meaning |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _schema_spelling(token: str) -> str:
    """A table key as the schema spells it: ``roles.<name>.x`` and ``roles."actor:rollout".x`` as roles.actor.x."""
    return token.replace("<name>", "actor").replace('"actor:rollout"', "actor").removesuffix(".*")


def test_every_key_of_the_schema_is_in_the_table() -> None:
    named = {_schema_spelling(token) for row in _rows() for token in re.findall(r"`([^`]+)`", " ".join(row))}
    missing = [key for key in all_keys(TrainConfig)
               if not any(key == name or key.startswith(name + ".") for name in named)]
    assert not missing, f"docs/configuration.md has no row for {missing}"


def test_every_key_the_table_names_exists() -> None:
    keys = [token for row in _rows() for token in re.findall(r"`([^`]+)`", row[0])]
    assert len(keys) > 40
    unknown = [key for key in keys if walk(TrainConfig, _schema_spelling(key))[0] == "unknown"]
    assert not unknown, f"docs/configuration.md names keys the schema does not have: {unknown}"


def test_a_key_moved_out_of_the_flat_config_is_not_in_the_table() -> None:
    from hybridflow.train.migration import MOVED

    keys = {token for row in _rows() for token in re.findall(r"`([^`]+)`", row[0])}
    flat = sorted(keys & set(MOVED))
    assert not flat, f"docs/configuration.md still names the flat keys {flat}"
