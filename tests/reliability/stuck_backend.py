"""The torch backend, except that ``generate`` never returns once ``<model dir>/STUCK`` exists (while the
process, and so its heartbeat, stays alive): a call only a deadline can end. Not collected by pytest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hybridflow.backends.torch.engine import BACKEND as TORCH

from hybridflow.planner import RoleLayout
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import RoleSpec, SamplingParams, WorkerContext


class StuckEngine:
    def __init__(self, engine: Any, marker: Path) -> None:
        self._engine, self._marker = engine, marker

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        while self._marker.exists():
            time.sleep(0.1)
        result: Batch = self._engine.generate(batch, sampling)
        return result

    def __getattr__(self, name: str) -> Any:  # every other capability is the torch engine's
        return getattr(self._engine, name)


class StuckBackend:
    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> Any:
        return StuckEngine(TORCH.build_role(spec, layout, context), Path(spec.model) / "STUCK")


BACKEND = StuckBackend()
