"""How a run executes its steps: one :class:`ExecutionMode` value, validated once, read by planner and runtime.

A plan records the mode its step time was costed for (``Plan.mode``); the controller runs the mode it is
given (the config's, or the plan's for ``pipeline: auto``). Whether a graph and placement can run a mode is
checked beside the graph (:func:`hybridflow.planner.modes.check_pipeline`, ``check_stream_chunks``); the
rules on the values alone live here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.graph.node import AGENT_SCHEDULES  # how a multi-turn generate node advances its trajectories

PIPELINES = ("sync", "one_step_off", "async")  # the execution modes a plan may record and the runtime runs
IMPLIED_STALENESS = {"sync": 0, "one_step_off": 1}  # the modes whose staleness bound is fixed
ASYNC_STALENESS = 1  # async's bound when none is given
# A rollout k updates ahead holds k steps of prompts and their samples in flight; far beyond any useful bound
# (published async runs use 1-8), and it keeps per-step loops and metrics over the lags small.
MAX_STALENESS = 1024
# A streamed step's schedule has a node per chunk and follower; a chunk is at least one prompt.
MAX_STREAM_CHUNKS = 1024


def _own_key(name: str) -> str:
    return f"ExecutionMode.{name}"


@dataclass(frozen=True, kw_only=True)
class ExecutionMode:
    """One execution mode. ``pipeline``: ``sync`` (every node of a step in that step), ``one_step_off`` (a
    detached rollout generates step t+1 while the trainer trains on step t) or ``async`` (it generates
    continuously, at most ``max_staleness`` updates ahead).

    ``max_staleness``: None takes the mode's bound (0 for sync, 1 for one_step_off, 1 for async); on
    construction it holds the resolved integer (read it as :attr:`k`). ``segment_tokens`` (async only):
    partial rollouts of at most that many new tokens per segment, so weight updates land mid-response;
    0 takes :meth:`segment_budget`'s default, None generates whole responses. ``stream_chunks`` (sync
    only): > 1 hands a generate node's rows on in that many chunks (``runtime/streaming.py``).
    ``agent_schedule``: how multi-turn generate nodes advance, ``trajectory`` (each trajectory sends its next
    turn as soon as its tools answer) or ``turn`` (every trajectory samples turn t together, then all tools
    run); None for a graph without multi-turn nodes (:mod:`hybridflow.planner.agents`).
    """

    pipeline: str = "sync"
    max_staleness: int | None = None
    segment_tokens: int | None = None
    stream_chunks: int = 1
    agent_schedule: str | None = None

    def __post_init__(self) -> None:
        staleness = validate_mode(self.pipeline, self.max_staleness, self.segment_tokens, self.stream_chunks,
                                  key=_own_key, agent_schedule=self.agent_schedule)
        object.__setattr__(self, "max_staleness", staleness)

    @classmethod
    def checked(cls, *, key: Callable[[str], str], pipeline: str = "sync", max_staleness: int | None = None,
                segment_tokens: int | None = None, stream_chunks: int = 1,
                agent_schedule: str | None = None) -> ExecutionMode:
        """The mode of these values, with errors naming each field as ``key(field)`` (a config key, an option)."""
        validate_mode(pipeline, max_staleness, segment_tokens, stream_chunks, key=key, agent_schedule=agent_schedule)
        return cls(pipeline=pipeline, max_staleness=max_staleness, segment_tokens=segment_tokens,
                   stream_chunks=stream_chunks, agent_schedule=agent_schedule)

    @property
    def k(self) -> int:
        """The staleness bound: policy updates a sample's oldest token may lag the trainer that takes it."""
        assert self.max_staleness is not None  # resolved on construction
        return self.max_staleness

    @property
    def overlapped(self) -> bool:
        """Whether a detached rollout generates beside the trainer (``one_step_off``, ``async``)."""
        return self.pipeline != "sync"

    def segment_budget(self, max_new_tokens: int) -> int | None:
        """New tokens per partial-rollout segment for a generate node of ``max_new_tokens`` (None: whole
        responses). ``segment_tokens=0`` takes a quarter of the budget; with k = 0 no update can land while a
        batch generates, so it generates whole (as ``sync`` does)."""
        if self.segment_tokens is None or self.k == 0:
            return None
        return self.segment_tokens or max(max_new_tokens // 4, 1)

    def to_dict(self) -> dict[str, Any]:
        """The mode's fields; ``agent_schedule`` only when set, so plans without agents read as they always did."""
        data: dict[str, Any] = {"pipeline": self.pipeline, "max_staleness": self.k,
                                "segment_tokens": self.segment_tokens, "stream_chunks": self.stream_chunks}
        if self.agent_schedule is not None:
            data["agent_schedule"] = self.agent_schedule
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionMode:
        """The mode a plan's JSON records: its ``pipeline``, ``max_staleness``, ``segment_tokens`` and
        ``stream_chunks`` keys (plans written before modes were costed run ``sync``; before streaming was a
        mode field, ``extra.stream_chunks`` held the chunks), and ``agent_schedule`` where a plan has agents."""
        pipeline = data.get("pipeline", "sync")
        # Older plans recorded 0 for one_step_off (the bound the runtime implied anyway).
        staleness = data.get("max_staleness") if pipeline == "async" else None
        extra: dict[str, Any] = dict(data.get("extra") or {})
        chunks: int = data.get("stream_chunks", extra.get("stream_chunks", 1))
        return cls(pipeline=pipeline, max_staleness=staleness, segment_tokens=data.get("segment_tokens"),
                   stream_chunks=chunks, agent_schedule=data.get("agent_schedule"))


def validate_mode(pipeline: str, max_staleness: int | None, segment_tokens: int | None, stream_chunks: int, *,
                  key: Callable[[str], str], agent_schedule: str | None = None) -> int:
    """The one check of an execution mode's values; returns the resolved staleness bound. ``key(field)`` is how
    errors name a field."""
    if pipeline not in PIPELINES:
        raise ValueError(f"{key('pipeline')}={pipeline!r} must be one of {list(PIPELINES)}")
    if max_staleness is not None and not _natural(max_staleness):
        raise ValueError(f"{key('max_staleness')}={max_staleness!r} must be an integer >= 0 (policy updates the "
                         "rollout may run ahead of the trainer)")
    if max_staleness is not None and max_staleness > MAX_STALENESS:
        raise ValueError(f"{key('max_staleness')}={max_staleness} must be <= {MAX_STALENESS}: the rollout holds that "
                         "many steps of samples in flight; async runs use 1-8")
    implied = IMPLIED_STALENESS.get(pipeline)
    if implied is not None and max_staleness not in (None, implied):
        raise ValueError(f"{key('max_staleness')}={max_staleness} with pipeline={pipeline!r}: that mode's staleness "
                         f"is {implied}; use pipeline='async' (or 'auto') for another bound")
    if segment_tokens is not None:
        if not _natural(segment_tokens):
            raise ValueError(f"{key('segment_tokens')}={segment_tokens!r} must be >= 0 (an integer; 0: a quarter of "
                             "the generate node's max_new_tokens; None: whole responses)")
        if pipeline != "async":
            raise ValueError(f"{key('segment_tokens')}={segment_tokens} with pipeline={pipeline!r}: partial "
                             "rollouts let async weight updates land mid-response; use pipeline='async' or "
                             "segment_tokens=None")
    if isinstance(stream_chunks, bool) or not isinstance(stream_chunks, int) or stream_chunks < 1:
        raise ValueError(f"{key('stream_chunks')}={stream_chunks!r} must be >= 1 (an integer; 1: no streaming)")
    if stream_chunks > MAX_STREAM_CHUNKS:
        raise ValueError(f"{key('stream_chunks')}={stream_chunks} must be <= {MAX_STREAM_CHUNKS} (and at most the "
                         "prompts of a step: a chunk holds whole prompts)")
    if stream_chunks > 1 and pipeline != "sync":
        raise ValueError(f"{key('stream_chunks')}={stream_chunks} streams within a sync step; pipeline={pipeline!r} "
                         "already overlaps generation with the rest of the step: use stream_chunks=1 or "
                         "pipeline='sync'")
    if agent_schedule is not None and agent_schedule not in AGENT_SCHEDULES:
        raise ValueError(f"{key('agent_schedule')}={agent_schedule!r} must be one of {list(AGENT_SCHEDULES)} or None "
                         "(trajectory: each trajectory sends its next turn when its tools answer; turn: "
                         "batch-synchronous turns)")
    if implied is not None:
        return implied
    return ASYNC_STALENESS if max_staleness is None else max_staleness


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
