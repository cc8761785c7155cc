"""Where a run's metrics and tables go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``trackers: [tensorboard, wandb, mlflow]`` in the config. None of them reaches the network by default:
wandb runs offline (``RUN_DIR/wandb``; ``wandb sync`` uploads later, ``WANDB_MODE=online`` logs live) and
MLflow writes a local file store (``RUN_DIR/mlruns``, opted into with ``MLFLOW_ALLOW_FILE_STORE``, which MLflow 3
asks for; ``MLFLOW_TRACKING_URI`` points it at a server or database instead).
wandb and mlflow are optional: ``pip install wandb`` / ``pip install mlflow-skinny``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Table = Sequence[Mapping[str, Any]]
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The ``logging`` section. ``trackers``: where metrics go besides ``metrics.jsonl`` (always written:
    ``hybridflow report`` reads it); ``progress``: a progress bar on stderr; ``plot``: ``report.png`` at the end
    of the run; ``console_every``: > 0 prints one line of key metrics every N steps (TRL/verl style)."""

    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    progress: bool = True
    plot: bool = True
    console_every: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.trackers) - set(TRACKERS))
        if unknown:
            raise ValueError(f"config key 'logging.trackers' has {unknown}; the trackers are {list(TRACKERS)}")
        if self.console_every < 0:
            raise ValueError(f"config key 'logging.console_every'={self.console_every} must be >= 0 (0: off)")


class Tracker(Protocol):
    """One destination for scalars (per step) and tables (validation samples)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_table(self, step: int, name: str, rows: Table) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars as TensorBoard scalars; a table as a markdown text summary."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, step: int, name: str, rows: Table) -> None:
        self.writer.add_text(name, markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run in ``RUN_DIR/wandb``, offline unless ``WANDB_MODE`` says otherwise."""

    def __init__(self, run_dir: Path, *, name: str, config: Mapping[str, Any]) -> None:
        wandb = _optional("wandb", "wandb")
        self.wandb = wandb
        self.run = wandb.init(dir=str(run_dir), name=name, project=os.environ.get("WANDB_PROJECT", "hybridflow"),
                              mode=os.environ.get("WANDB_MODE", "offline"), config=dict(config), reinit=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, step: int, name: str, rows: Table) -> None:
        columns = list(rows[0]) if rows else []
        self.run.log({name: self.wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in the local file store ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set."""

    def __init__(self, run_dir: Path, *, name: str, config: Mapping[str, Any]) -> None:
        mlflow = _optional("mlflow", "mlflow-skinny")
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store (no server, no database driver) behind an opt-in; it is what a run
            # directory that is copied around wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("hybridflow")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("hybridflow")
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        flat = _flatten(config)
        for key, value in list(flat.items())[:500]:  # MLflow caps a parameter at 6000 characters
            self.client.log_param(self.run_id, key, str(value)[:6000])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = _now_ms()
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), stamp, step)
                                                    for key, value in metrics.items()])

    def log_table(self, step: int, name: str, rows: Table) -> None:
        self.client.log_text(self.run_id, "".join(json.dumps(dict(row)) + "\n" for row in rows),
                             f"{name}/step_{step:06d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def make_trackers(names: Sequence[str], run_dir: Path, *, name: str, config: Mapping[str, Any]) -> list[Tracker]:
    """The trackers ``names`` lists (``jsonl`` is ``metrics.jsonl``, always written, so it adds none)."""
    trackers: list[Tracker] = []
    for tracker in dict.fromkeys(names):
        if tracker == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
        elif tracker == "wandb":
            trackers.append(WandbTracker(run_dir, name=name, config=config))
        elif tracker == "mlflow":
            trackers.append(MlflowTracker(run_dir, name=name, config=config))
        elif tracker != "jsonl":
            raise ValueError(f"config key 'logging.trackers': unknown tracker {tracker!r}; the trackers are "
                             "['jsonl', 'tensorboard', 'wandb', 'mlflow']")
    return trackers


def markdown_table(rows: Table) -> str:
    """Rows as a markdown table (cells with ``|`` and newlines escaped)."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]).replace("|", "\\|").replace("\n", "\\n") for c in columns) + " |")
    return "\n".join(lines)


def _optional(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"config key 'logging.trackers' lists {module!r}, which is not installed: pip install "
                          f"{package} (or drop {module} from logging.trackers)") from err


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
