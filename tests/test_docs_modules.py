"""Every module or folder a documentation table or module listing names exists in the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
# `backends/common/training.py`, `hybridflow/runtime/`, `runtime/step_store.py` in tables and listings.
PATH = re.compile(r"`((?:hybridflow|backends|algorithms|runtime|tests|benchmarks)/[\w/.]*)`")
LISTING = re.compile(r"^```\n(hybridflow/runtime/\n(?:.*\n)*?)```", re.MULTILINE)


def _named_paths(text: str) -> set[str]:
    names = set(PATH.findall(text))
    for block in LISTING.findall(text):  # the module listing in runtime.md: "  name.py  what it does"
        folder = block.splitlines()[0]
        names |= {folder + line.split()[0] for line in block.splitlines()[1:] if line.startswith("  ")}
        names |= {line.split()[0] for line in block.splitlines()[1:] if line and not line.startswith(" ")}
    return names


def _exists(name: str) -> bool:
    name = name.rstrip("/")
    candidates = [ROOT / name, ROOT / "hybridflow" / name]
    return any(path.exists() for path in candidates)


@pytest.mark.parametrize("doc", DOCS, ids=[doc.name for doc in DOCS])
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    missing = sorted(name for name in _named_paths(doc.read_text()) if not _exists(name))
    assert not missing, f"{doc.name} names modules that do not exist: {missing}"


def test_the_runtime_listing_is_read() -> None:
    names = _named_paths((ROOT / "docs" / "runtime.md").read_text())
    assert {"hybridflow/runtime/step_store.py", "hybridflow/runtime/dispatch.py", "backends/common/"} <= names
