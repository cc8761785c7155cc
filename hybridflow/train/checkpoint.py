"""Atomic checkpoints: written into a temporary directory, then renamed into place.

``trainer.json`` records each role's checkpoint format (``"formats": {"actor": "torch"}``), read from the
files the backend has just written into the fresh temporary directory; ``hybridflow export`` reads only
the recorded format, so files added to a checkpoint later (a crafted DCP ``.metadata``) are never opened.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.train.file_checks import MANIFEST, checkpoint_problem, json_problem

_PREFIX = "step_"
DEEPSPEED_TAG = "hybridflow"  # backends/deepspeed/engine.py CHECKPOINT_TAG
# The file (or folder) each backend's role checkpoint is made of, in the order they are told apart.
FORMAT_MARKERS = {"torch": "state.pt", "fsdp": ".metadata", "deepspeed": DEEPSPEED_TAG}


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``checkpoint`` section. ``every``: a checkpoint every N steps (0: none but the one a SIGTERM
    asks for); ``keep``: > 0 keeps only the newest K on disk; ``sigterm_grace_s``: on SIGTERM the step in
    flight gets this long to finish (else it is abandoned), then the last finished step is checkpointed and the
    run exits 143; 0: stop at once, no checkpoint (hybridflow/train/preemption.py)."""

    every: int = 0
    keep: int = 0
    sigterm_grace_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            if getattr(self, name) < 0:
                raise ValueError(f"config key 'checkpoint.{name}'={getattr(self, name)} must be >= 0 (0: off)")
        if not 0 <= self.sigterm_grace_s < math.inf:
            raise ValueError(f"config key 'checkpoint.sigterm_grace_s'={self.sigterm_grace_s} must be a number of "
                             "seconds >= 0 (0: a SIGTERM stops the run at once, without a checkpoint)")


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
    state = {**state, "formats": written_formats(tmp / "roles")}
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **state}, indent=2))
    _write_manifest(tmp)
    _sync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _sync(final.parent)  # the rename itself
    return final


def _write_manifest(root: Path) -> None:
    """Every file's size (:data:`MANIFEST`): resume then tells a truncated shard of any backend's format from a
    whole one without reading it (:func:`~hybridflow.train.file_checks.manifest_problem`)."""
    files = {path.relative_to(root).as_posix(): path.stat().st_size for path in sorted(root.rglob("*"))
             if path.is_file()}
    (root / MANIFEST).write_text(json.dumps({"files": files}, indent=0))


def written_formats(roles: Path) -> dict[str, str]:
    """``{role: format}`` of the role directories a backend has just written under ``roles`` (torch, fsdp,
    deepspeed; ``unknown`` for a custom backend's own layout)."""
    found = sorted(p for p in roles.iterdir() if p.is_dir()) if roles.is_dir() else []
    return {path.name: files_format(path) or "unknown" for path in found}


def files_format(path: Path) -> str | None:
    """The format a role directory's files look like; trusted only for a directory this process just wrote."""
    for kind, marker in FORMAT_MARKERS.items():
        if (path / marker).exists():
            return kind
    return None


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


def newest_intact_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint whose files are intact (:func:`checkpoint_problem`), and what was wrong
    with each newer one skipped on the way (a line naming the file)."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob(f"{_PREFIX}*") if p.name[len(_PREFIX):].isdigit() and (p / "trainer.json").is_file()
             ] if root.is_dir() else []
    skipped: list[str] = []
    for path in sorted(found, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(problem)
    return None, skipped


def checkpoint_step(path: Path) -> int:
    """The step ``path/trainer.json`` records; a broken file is named with the fix."""
    trainer = path / "trainer.json"
    problem = json_problem(trainer)
    step = json.loads(trainer.read_text()).get("step") if problem is None else None
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointError(f"{trainer} {problem or f'has no integer step (got {step!r})'}; the checkpoint is "
                              "unusable: resume from an older one (--resume-from checkpoints/step_N) or delete it")
    return step


class CheckpointError(ValueError):
    """A checkpoint file that is truncated, corrupt or not what its name says; the message names the file."""
