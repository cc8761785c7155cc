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

    A crash mid-write leaves only a ``.tmp`` directory, which :func:`latest_checkpoint` ignores. Every file
    is flushed to disk before the rename, so a power loss cannot leave a renamed checkpoint with empty files.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_roles(str(tmp / "roles"))
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **state}, indent=2))
    _sync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _sync(final.parent)  # the rename itself
    return final


def _sync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):  # files before the directories that hold them
        _sync(path)
    _sync(root)


def _sync(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # a dangling link or a file a backend removed meanwhile: nothing to flush
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(descriptor)


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
