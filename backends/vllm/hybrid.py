"""The hybrid engine: a trainer and a vLLM rollout of the same policy in one process, weights handed over
in place after every update.

The trainer's whole weights are streamed one tensor at a time into the engine (an FSDP trainer gathers
each parameter just before it is copied), so besides the two engines' own weights at most one gathered
tensor exists at a time. Sync is lazy: it happens before the first generation after an update.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from hybridflow.backends.vllm.engine import VllmOptions, sample_seed, start_rollout

from hybridflow.planner import RoleLayout
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import LossFn, RoleSpec, SamplingParams, WorkerContext
from hybridflow.runtime.weights import WeightSyncStats, full_weights


class HybridEngine:
    """A policy engine that generates on vLLM and does everything else on its trainer.

    ``trainer`` is a training backend's engine (a generator, log-prob model, trainer and weight source
    and sink). ``train_step`` metrics carry the last sync's cost (``weight_sync/seconds``, ``bytes``...).
    """

    def __init__(self, trainer: Any, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> None:
        self.trainer, self.spec, self.context = trainer, spec, context
        self.options = VllmOptions.parse(spec.rollout_options, spec.name)
        self.rollout, self._model_dir = start_rollout(spec, self.options, layout, context)
        self.stale = False  # both engines start from the same seeded weights
        self.last_sync: WeightSyncStats | None = None

    def _trainer_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's whole weights in the rollout's dtype (fp32 masters travel as bf16 for a bf16 engine,
        one tensor at a time), so bytes per sync match the planner's ``params x dtype`` estimate."""
        return full_weights(self.trainer, self.rollout.config.dtype)

    def sync_weights(self) -> WeightSyncStats:
        """Copy the trainer's current weights into the rollout engine now."""
        self.last_sync = self.rollout.load_weights(self._trainer_weights())
        self.stale = False
        return self.last_sync

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        if self.stale or self.rollout.needs_weights:
            self.sync_weights()
        self.rollout.wake_up()
        out = self.rollout.generate(batch, sampling, seed=sample_seed(sampling, self.context.rank))
        if self.options.sleep_level:
            self.rollout.sleep(self.options.sleep_level)
        return out

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        return self.trainer.log_probs(batch, with_entropy=with_entropy)

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        metrics = self.trainer.train_step(batch, loss=loss, options=options)
        self.stale = True
        return {**metrics, **(self.last_sync.metrics() if self.last_sync else {})}

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.trainer.iter_full_weights()

    def tied_weights(self) -> Mapping[str, str]:
        return self.trainer.tied_weights()

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.trainer.load_weights(named)
        self.stale = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)
        self.stale = True

    def close(self) -> None:
        """The trainer first: stopping an in-process vLLM engine tears down torch.distributed's default group."""
        self.trainer.close()
        self.rollout.shutdown()
