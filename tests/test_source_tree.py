"""Importing the mapped sub-packages works from the source checkout, not only from the install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import hybridflow, hybridflow.backends, hybridflow.algorithms.graphs; "
         "print(hybridflow.__file__); print(hybridflow.algorithms.graphs.__file__)")


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "examples"], ids=["root", "examples"])
def test_python_c_imports_backends_and_algorithms(cwd: Path) -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert result.returncode == 0, result.stderr
    package, graphs = result.stdout.split()
    if cwd == ROOT:  # the source folder shadows the install there: the finder must map the sub-packages
        assert Path(package).resolve() == ROOT / "hybridflow" / "__init__.py"
    assert Path(graphs).resolve() == ROOT / "algorithms" / "graphs.py"
