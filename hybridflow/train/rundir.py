"""Run directories: one run per ``output_dir``, resumed only from a checkpoint of the same config and graph.

- A fresh run refuses a directory that already holds files (``--overwrite`` replaces a previous run,
  ``--resume`` continues it), so old checkpoints never mix with a new run's metrics.
- ``--resume`` needs a checkpoint; ``--resume-from PATH`` names one (possibly of another run).
- Each checkpoint records a fingerprint: the config keys that decide what is trained plus a digest of the
  graph. Resuming with a different one is refused, listing the keys that differ, unless the caller
  allows it (``--allow-config-change``).
- A torn last line of ``metrics.jsonl`` (a crash mid-write) is dropped on resume and reported.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph
from hybridflow.graph.render import to_json
from hybridflow.train.checkpoint import checkpoint_step, latest_checkpoint, newest_intact_checkpoint
from hybridflow.train.config import TrainConfig
from hybridflow.train.config_keys import shorthand
from hybridflow.train.file_checks import checkpoint_problem
from hybridflow.train.migration import moved_key

# Keys that change how a run is executed, observed or how long it goes, not what a step computes:
# resuming with other values is the normal case (more steps, another executor, a quieter console).
RUN_ONLY_KEYS = ("steps", "output_dir", "executor", "logging", "checkpoint", "validation")  # keys or whole sections
# What hybridflow writes into a run directory; --overwrite removes only these (never a user's other files).
RUN_FILES = ("config.json", "plan.json", "metrics.jsonl", "checkpoints", "tensorboard", "reward_curve.png",
             "report.html", "plots", "final", "validation_samples.jsonl", "torchrun_workers.json",
             "wandb", "mlruns")  # the last two: what the wandb and mlflow trackers write (hybridflow/train/trackers.py)
KEPT_ON_OVERWRITE = ("init_model",)  # a cache keyed by its recipe (hybridflow_init.json): safe to reuse


class RunDirectoryError(ValueError):
    """The run directory or checkpoint does not fit the requested start (fresh, resume, resume-from)."""


def fingerprint(config: TrainConfig, graph: Graph) -> dict[str, Any]:
    """The flattened config keys that decide what is trained, plus ``graph`` (a digest of the graph)."""
    flat = _flatten(asdict(config))
    kept = {key: value for key, value in flat.items() if key.split(".")[0] not in RUN_ONLY_KEYS}  # a key's section
    kept["graph"] = hashlib.sha256(to_json(graph).encode()).hexdigest()[:16]
    return kept


def differing_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: saved -> current`` for each key whose value differs (or exists on one side only)."""
    missing = object()
    out = []
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key, missing), current.get(key, missing)
        if before != after:
            out.append(f"{key}: {_show(before, missing)} -> {_show(after, missing)}")
    return out


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, resume_from: str | None = None) -> None:
    """Make ``run_dir``; refuse one that already holds a run unless resuming or overwriting it."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirectoryError(f"output_dir {str(run_dir)!r} is a file, not a directory; choose another output_dir")
    present = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if present and overwrite:
        foreign = [name for name in present if name not in RUN_FILES + KEPT_ON_OVERWRITE]
        if foreign:
            raise RunDirectoryError(f"output_dir {str(run_dir)!r} holds files a run does not write ({foreign[:5]}); "
                                    "--overwrite only replaces a previous run's outputs: choose an empty output_dir")
        for name in present:
            if name not in KEPT_ON_OVERWRITE:
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif present and not resume and [name for name in present if name not in KEPT_ON_OVERWRITE]:
        what = "a previous run" if "config.json" in present or "checkpoints" in present else f"files ({present[:5]})"
        latest, _ = newest_intact_checkpoint(run_dir)
        saved = f", checkpoints up to step {checkpoint_step(latest)}" if latest else ""
        start = "" if resume_from else "--resume to continue it, "
        raise RunDirectoryError(f"output_dir {str(run_dir)!r} already holds {what}{saved}; pass {start}--overwrite "
                                "to replace it, or choose another output_dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except PermissionError as err:
        raise RunDirectoryError(f"cannot create output_dir {str(run_dir)!r}: permission denied; choose a "
                                "writable directory") from err


def find_checkpoint(run_dir: Path, *, resume: bool, resume_from: str | None) -> Path | None:
    """The checkpoint to start from: ``resume_from``, the newest intact one in ``run_dir`` with ``resume`` (newer
    ones with a truncated or corrupt file are skipped with a warning naming it), else None."""
    if resume_from is not None:
        path = Path(resume_from).resolve()
        if not (path / "trainer.json").is_file():
            if not path.is_dir() or latest_checkpoint(path) is None:
                raise RunDirectoryError(f"--resume-from {resume_from!r} is not a checkpoint (no trainer.json) nor a "
                                        "run directory with checkpoints; pass a checkpoints/step_N directory")
            return _newest_intact(path, flag=f"--resume-from {resume_from!r}")
        problem = checkpoint_problem(path)
        if problem is not None:
            older, _ = newest_intact_checkpoint(path.parent.parent)
            hint = f"--resume-from {older}" if older is not None else "a fresh run"
            raise RunDirectoryError(f"--resume-from {resume_from!r}: {problem}; the checkpoint cannot be loaded: "
                                    f"use {hint} (or restore the file)")
        return path
    if not resume:
        return None
    return _newest_intact(run_dir, flag=f"--resume: output_dir {str(run_dir)!r}")


def _newest_intact(run_dir: Path, *, flag: str) -> Path:
    newest, skipped = newest_intact_checkpoint(run_dir)
    for problem in skipped:
        print(f"hybridflow: warning: skipping a broken checkpoint: {problem}", file=sys.stderr)
    if newest is None:
        broken = f" ({len(skipped)} broken: {skipped[0]})" if skipped else ""
        raise RunDirectoryError(f"{flag} holds no complete checkpoint to resume from{broken}; start a fresh run "
                                "(without --resume; --overwrite if the directory is not empty) or set "
                                "checkpoint.every so runs leave checkpoints")
    if skipped:
        print(f"hybridflow: warning: resuming from {newest}, the newest intact checkpoint", file=sys.stderr)
    return newest


def check_fingerprint(checkpoint: Path, current: Mapping[str, Any], *, allow_change: bool) -> list[str]:
    """Refuse ``checkpoint`` when its recorded fingerprint differs from ``current`` (unless ``allow_change``);
    returns the differing keys (reported as a warning when allowed)."""
    saved = json.loads((checkpoint / "trainer.json").read_text()).get("fingerprint")
    if saved is None:
        print(f"hybridflow: warning: checkpoint {checkpoint} predates config fingerprints; its config is not "
              "checked against this run's", file=sys.stderr)
        return []
    changed = differing_keys(_sectioned(saved), current)
    if changed and not allow_change:
        raise RunDirectoryError(f"checkpoint {checkpoint} was written with another config or graph; differing keys: "
                                f"{'; '.join(changed)}. Resume with the same config, or pass --resume-from "
                                f"{checkpoint} --allow-config-change to start from it deliberately")
    if changed:
        print(f"hybridflow: resuming {checkpoint} with a changed config: {'; '.join(changed)}", file=sys.stderr)
    return changed


def _sectioned(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A fingerprint written before the config's sections, in today's keys (hybridflow/train/migration.py; a
    plain ``algorithm`` or ``pipeline`` value is its section's short field, :func:`config_keys.shorthand`)."""
    moved = dict(shorthand(TrainConfig, [(moved_key(key, value) or key, value) for key, value in saved.items()]))
    return {key: value for key, value in moved.items() if key.split(".")[0] not in RUN_ONLY_KEYS}


def check_steps_left(checkpoint: Path, steps: int) -> int:
    """The checkpoint's step, refusing a run that would train nothing."""
    start = checkpoint_step(checkpoint)
    if start == steps:
        raise RunDirectoryError(f"the run is finished: checkpoint {checkpoint} is at its last step ({steps}), "
                                f"nothing left to train (its policy is in final/); raise steps (e.g. "
                                f"steps={2 * steps}) to train on")
    if start > steps:
        raise RunDirectoryError(f"checkpoint {checkpoint} is at step {start} and steps={steps}: nothing left to "
                                f"train; raise steps (e.g. steps={start + steps}) to continue")
    return start


def repair_metrics(path: Path) -> int:
    """Drop lines of ``metrics.jsonl`` that are not whole JSON objects (a crash mid-write); returns how many,
    after saying so on stderr."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept, torn = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn.append(number)
            continue
        if isinstance(row, dict) and "step" in row:
            kept.append(line)
        else:
            torn.append(number)
    if torn:
        path.write_text("".join(line + "\n" for line in kept))
        print(f"hybridflow: {path}: dropped {len(torn)} torn line(s) (line {', '.join(map(str, torn))}) left by an "
              "interrupted write", file=sys.stderr)
    return len(torn)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.loads(json.dumps(value, default=str))  # as saved in trainer.json
    return out


def _show(value: Any, missing: object) -> str:
    return "(absent)" if value is missing else json.dumps(value, default=str)


@dataclass(frozen=True, kw_only=True)
class RunStart:
    """Where a run starts: the checkpoint to load (None: from scratch), its step, and this run's fingerprint."""

    checkpoint: Path | None
    step: int
    fingerprint: dict[str, Any]


def begin_run(run_dir: Path, config: TrainConfig, graph: Graph, *, resume: bool = False, overwrite: bool = False,
              resume_from: str | None = None, allow_config_change: bool = False) -> RunStart:
    """Check the start a caller asked for against ``run_dir`` and the checkpoint, then make the directory."""
    if resume and overwrite:
        raise RunDirectoryError("--resume and --overwrite contradict each other: resume continues the run in "
                                "output_dir, overwrite discards it; pass one")
    if allow_config_change and not (resume or resume_from):
        raise RunDirectoryError("--allow-config-change only applies when resuming (--resume or --resume-from PATH)")
    if resume and resume_from:
        raise RunDirectoryError("pass --resume (the newest checkpoint in output_dir) or --resume-from PATH, not both")
    current = fingerprint(config, graph)
    checkpoint = find_checkpoint(run_dir, resume=resume, resume_from=resume_from)
    step = 0
    if checkpoint is not None:
        check_fingerprint(checkpoint, current, allow_change=allow_config_change)
        step = check_steps_left(checkpoint, config.steps)
    inside = checkpoint is not None and run_dir.resolve() in checkpoint.resolve().parents
    if inside and overwrite:
        raise RunDirectoryError(f"--overwrite would delete {checkpoint}, the checkpoint to resume from; drop "
                                "--overwrite (a checkpoint of this run resumes in place)")
    prepare_run_dir(run_dir, resume=resume or inside, overwrite=overwrite, resume_from=resume_from)
    if resume:
        repair_metrics(run_dir / "metrics.jsonl")
    return RunStart(checkpoint=checkpoint, step=step, fingerprint=current)
