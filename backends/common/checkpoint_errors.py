"""A role checkpoint that cannot be loaded, as one error: the file (or directory), what failed, and the fix.

The run checks a checkpoint's files before any worker loads it (``hybridflow/train/file_checks.py``), so
``--resume`` skips a broken one; these errors are for what those structural checks cannot see (a shard
overwritten in place) and for callers that load a role directory directly.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

FIX = "it is truncated or corrupt: resume from an older checkpoint (--resume-from checkpoints/step_N)"
# What torch.load, DCP and DeepSpeed raise for a truncated or garbled file (DCP's CheckpointException is a
# BaseException: it wraps each rank's own error, see ``cause``).
LOAD_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError,
                                                zipfile.BadZipFile)


def unloadable(path: str | Path, err: BaseException, *, backend: str) -> ValueError:
    """The error for ``path`` (a file, or a role's checkpoint directory) failing to load with ``err``."""
    named = Path(path)
    broken = first_non_archive(named) if named.is_dir() else None
    where = f"the {backend} checkpoint {named}"
    if broken is not None:
        where = f"{broken} (in {where})"
    return ValueError(f"{where} cannot be loaded ({cause(err)}); {FIX}")


def cause(err: BaseException) -> str:
    """``err`` on one line; for DCP's CheckpointException, the first failing rank's own error."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {_line(inner)}"
    return _line(err)


def first_non_archive(directory: Path) -> Path | None:
    """The first ``.pt`` file under ``directory`` that is not a whole zip archive (torch.save writes zips)."""
    for path in sorted(directory.rglob("*.pt")):
        if not zipfile.is_zipfile(path):
            return path
    return None


def _line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
