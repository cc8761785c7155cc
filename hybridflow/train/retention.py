"""``keep_checkpoints: K``: only the newest K complete checkpoints of a run stay on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

from hybridflow.train.checkpoint import checkpoint_step


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (``keep=0``: keep all); returns those deleted.

    Only complete checkpoints (with ``trainer.json``) count and go, so the one being written (a ``.tmp``
    directory) and the newest one a resume needs are never touched.
    """
    root = run_dir / "checkpoints"
    if keep <= 0 or not root.is_dir():
        return []
    complete = sorted((p for p in root.glob("step_*") if (p / "trainer.json").is_file()), key=checkpoint_step)
    doomed = complete[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
