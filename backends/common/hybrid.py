"""The hybrid engine: a trainer and a rollout engine of the same policy in one process, weights handed over
in place after every update.

The rollout engine is any :class:`~hybridflow.runtime.protocols.Generator` that is also a
:class:`~hybridflow.runtime.protocols.WeightSink` (vLLM's is one). The trainer's whole weights are streamed
into it one tensor at a time (an FSDP trainer gathers each parameter just before it is copied), so besides
the two engines' own weights at most one gathered tensor exists at a time. Sync is lazy: it happens before
the first generation after an update.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import (
    AdapterSink,
    Engine,
    GenerateBatch,
    Generator,
    LossFn,
    SamplingParams,
    TrainedWeightSource,
    WeightSink,
)
from hybridflow.runtime.weights import CountedWeights, WeightSyncStats, adapter_weights, full_weights


@runtime_checkable
class SleepingRollout(Protocol):
    """A rollout engine that gives its memory back between generations (vLLM's sleep mode)."""

    @property
    def needs_weights(self) -> bool:
        """True after a sleep that discarded the weights: the next generation must load them first."""
        ...

    def sleep(self, level: int) -> None:
        ...

    def wake_up(self) -> None:
        ...


class HybridEngine:
    """A policy engine that generates on ``rollout`` and does everything else on ``trainer``.

    ``trainer`` is a training backend's engine (a generator, log-prob model, trainer, weight source and
    sink). Weights travel cast to ``weight_dtype`` (a plan dtype: the rollout's), so bytes per sync match
    the planner's ``params x dtype`` estimate. ``synced``: the rollout starts from the trainer's weights
    (the same model and seed), so the first generation needs no sync; False syncs first. ``sleep_level``
    > 0 puts a :class:`SleepingRollout` to sleep after each generation. ``adapter_sync``: a LoRA trainer's
    updates travel as its adapter alone into an :class:`~hybridflow.runtime.protocols.AdapterSink` (the rollout
    holds the base from its start: peft's default and gaussian inits leave the adapted model equal to it, so
    ``synced`` still holds). ``train_step`` metrics carry the last sync's cost (``weight_sync/seconds``...).
    """

    def __init__(self, trainer: Any, rollout: Any, *, weight_dtype: str, synced: bool = True,
                 sleep_level: int = 0, adapter_sync: bool = False) -> None:
        missing = [cap.__name__ for cap in (Engine, Generator, WeightSink) if not isinstance(rollout, cap)]
        if missing:
            raise TypeError(f"a hybrid engine's rollout must be an Engine, a Generator and a WeightSink; a "
                            f"{type(rollout).__name__} is not a {' or '.join(missing)}")
        if sleep_level and not isinstance(rollout, SleepingRollout):
            raise ValueError(f"sleep_level={sleep_level}: a {type(rollout).__name__} cannot sleep (no sleep/wake_up/"
                             "needs_weights); use sleep_level 0")
        if adapter_sync and not (isinstance(rollout, AdapterSink) and getattr(trainer, "has_adapters", False)):
            raise ValueError(f"adapter_sync=True needs a trainer with LoRA adapters and a rollout that takes them; "
                             f"got a {type(trainer).__name__} and a {type(rollout).__name__}")
        self.trainer, self.rollout = trainer, rollout
        self.weight_dtype, self.sleep_level, self.adapter_sync = weight_dtype, sleep_level, adapter_sync
        self.stale = not synced
        self.last_sync: WeightSyncStats | None = None

    def executed_layout(self) -> dict[str, Any]:
        """The trainer's report of what it runs (the rollout engine decodes the plan's ``rollout_tp``)."""
        report = getattr(self.trainer, "executed_layout", None)
        return report() if report is not None else {}

    def sync_weights(self) -> WeightSyncStats:
        """Copy the trainer's current weights (with ``adapter_sync``, its adapter) into the rollout engine now."""
        start = time.perf_counter()
        if self.adapter_sync:
            counted = CountedWeights(adapter_weights(self.trainer, self.weight_dtype))
            self.rollout.load_adapter(counted, self.trainer.adapter_config())
        else:
            counted = CountedWeights(full_weights(self.trainer, self.weight_dtype, trained_only=True))
            self.rollout.load_weights(counted)
        self.last_sync = counted.stats(time.perf_counter() - start)
        self.stale = False
        return self.last_sync

    @contextlib.contextmanager
    def _awake(self) -> Iterator[None]:
        """The rollout engine with the trainer's current weights, woken for the duration (and put back to sleep)."""
        sleeper = self.rollout if isinstance(self.rollout, SleepingRollout) else None
        if self.stale or (sleeper is not None and sleeper.needs_weights):
            self.sync_weights()
        if sleeper is not None:
            sleeper.wake_up()
        try:
            yield
        finally:
            if sleeper is not None and self.sleep_level:
                sleeper.sleep(self.sleep_level)

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        with self._awake():
            return self.rollout.generate(batch, sampling)

    @contextlib.contextmanager
    def turn_session(self, sampling: SamplingParams) -> Iterator[GenerateBatch]:
        """Agent turns on the rollout engine (:class:`~hybridflow.runtime.protocols.TurnGenerator`)."""
        session = getattr(self.rollout, "turn_session", None)
        if session is None:
            raise TypeError(f"rollout engine {type(self.rollout).__name__} samples no agent turns (it has no "
                            "turn_session); run multi-turn generate nodes with rollout: native or vllm")
        with self._awake(), session(sampling) as generate_batch:
            yield generate_batch

    def log_probs(self, batch: Batch, *, with_entropy: bool = False, adapters: bool = True) -> Batch:
        if adapters:  # a trainer without adapters takes no switch
            return self.trainer.log_probs(batch, with_entropy=with_entropy)
        return self.trainer.log_probs(batch, with_entropy=with_entropy, adapters=False)

    @property
    def has_adapters(self) -> bool:
        return bool(getattr(self.trainer, "has_adapters", False))

    def iter_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        adapter_weights: Iterator[tuple[str, torch.Tensor]] = self.trainer.iter_adapter_weights()
        return adapter_weights

    def adapter_config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.trainer.adapter_config()
        return config

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        metrics = self.trainer.train_step(batch, loss=loss, options=options)
        self.stale = True
        return {**metrics, **(self.last_sync.metrics() if self.last_sync else {})}

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.trainer.iter_full_weights()

    def iter_trained_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        trainer = self.trainer
        if isinstance(trainer, TrainedWeightSource):
            return trainer.iter_trained_weights()
        return self.iter_full_weights()

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
        self.rollout.close()
