"""The ``pipeline`` section: how a step's generation overlaps its training, and how its passes run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from hybridflow.planner import ExecutionMode, Plan
from hybridflow.planner.modes import check_choice

# The planner's field names for the mode's values, as this section spells them.
_KEYS = {"pipeline": "mode", "max_staleness": "max_staleness", "segment_tokens": "segment_tokens",
         "stream_chunks": "stream_chunks"}


def _key(name: str) -> str:
    return f"config key 'pipeline.{_KEYS.get(name, name)}'"


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """``mode``: ``sync``; ``one_step_off`` (a rollout on GPUs of its own generates step t+1 while the trainer
    trains on step t); ``async`` (it generates continuously, at most ``max_staleness`` policy updates ahead,
    weight updates landing mid-response with ``partial_rollout``, in segments of ``segment_tokens`` new tokens,
    0: a quarter of max_new_tokens); ``auto`` (the mode the plan was costed for: ``placement.mode: auto``
    chooses it, a plan file records it). docs/runtime.md.

    ``stream_chunks``: with ``sync``, > 1 hands generated rows on in that many chunks (runtime/streaming.py);
    ``padding``: forward and update passes over padded rows instead of packed sequences (every role's
    ``RoleLayout.padding``); ``skip_known_passes``: a synchronous single-pass update (optim.actor.epochs 1,
    optim.actor.mini_batches 1) takes its old log-probs from its own forward, detached, instead of a log-prob pass
    before it (hybridflow/graph/skipping.py; TRL does the same).
    """

    SHORT: ClassVar[str] = "mode"
    mode: Literal["sync", "one_step_off", "async", "auto"] = "sync"
    max_staleness: int = 1
    partial_rollout: bool = True
    segment_tokens: int = 0
    stream_chunks: int = 1
    padding: bool = False
    skip_known_passes: bool = True

    def __post_init__(self) -> None:
        # The mode's values by the one rule: each as async reads it (whichever mode runs), then the mode.
        ExecutionMode.checked(key=_key, pipeline="async", max_staleness=self.max_staleness,
                              segment_tokens=self.segment_tokens)
        if self.mode == "auto":
            check_choice("auto", self.max_staleness, self.stream_chunks, key=_key)
        else:
            self.execution_mode()

    def execution_mode(self, plan: Plan | None = None) -> ExecutionMode:
        """The mode the run executes: this section's, or for ``mode: auto`` the one ``plan`` was costed for (its
        mode and bound; this section's segments and chunks). ``max_staleness`` applies to async only,
        ``segment_tokens`` to async with ``partial_rollout``. Errors name the config key."""
        mode: str = self.mode
        staleness = self.max_staleness
        if mode == "auto":
            if plan is None:
                raise ValueError("config key 'pipeline.mode'='auto' runs the mode a plan was costed for: pass the plan")
            mode, staleness = plan.pipeline, plan.max_staleness
        return ExecutionMode.checked(
            key=_key, pipeline=mode, max_staleness=staleness if mode == "async" else None,
            segment_tokens=self.segment_tokens if mode == "async" and self.partial_rollout else None,
            stream_chunks=self.stream_chunks)
