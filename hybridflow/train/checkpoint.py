"""Atomic checkpoints: written into a temporary directory, then renamed into place."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{_PREFIX}{step:06d}"


def save_checkpoint(run_dir: Path, step: int, write_roles: Callable[[str], None], state: dict[str, Any]) -> Path:
    """Write role states (``write_roles(dir)``) and ``trainer.json`` to a temp dir, then rename it.

    A crash mid-write leaves only a ``.tmp`` directory, which :func:`latest_checkpoint` ignores.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_roles(str(tmp / "roles"))
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **state}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob(f"{_PREFIX}*") if p.name[len(_PREFIX):].isdigit() and (p / "trainer.json").is_file()
             ] if root.is_dir() else []
    # By step number, not name: step_1000000 (7 digits) comes after step_999999.
    return max(found, key=lambda p: int(p.name[len(_PREFIX):])) if found else None


def checkpoint_step(path: Path) -> int:
    step: int = json.loads((path / "trainer.json").read_text())["step"]
    return step
