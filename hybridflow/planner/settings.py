"""How a run executes a step, beyond its placement: response lengths, PPO mini-batches, dynamic batching,
CPU offload, the rollout engine's memory and sleep/wake. These are the run's choices (verl's config keys
in brackets), not the planner's; the default is the plainest run (one optimizer step, no offload).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.planner.lengths import LengthDistribution


@dataclass(frozen=True, kw_only=True)
class Offload:
    """What a role keeps in host memory between its phases [``fsdp_config.param_offload`` ...]."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer


NO_OFFLOAD = Offload()


def _positive_int(owner: str, name: str, value: Any, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer" + (" or None" if allow_none else ""))


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """A run's step recipe. Every field has a verl equivalent; ``None`` means "not used".

    - ``lengths``: response lengths; None means every response is ``Workload.response_len`` long.
      With a distribution, ``Workload.response_len`` should be its mean (the graph sizes edges with it).
    - ``padding``: forward and update passes see padded rows (every response at the max length)
      instead of packed ones [``use_remove_padding=False``].
    - ``mini_batch_size``: sequences per optimizer step [``ppo_mini_batch_size`` x ``n``]; ``epochs``
      [``ppo_epochs``]. None: the whole batch is one mini-batch.
    - ``train_tokens_per_gpu`` / ``forward_tokens_per_gpu``: dynamic batching budgets
      [``ppo_max_token_len_per_gpu``, ``log_prob_max_token_len_per_gpu``]; they replace row micro batches.
    - ``offload``: per role [``actor.fsdp_config.param_offload`` ...].
    - ``gpu_memory_utilization``: the rollout engine's share of device memory (weights + KV cache);
      None lets the planner size the engine's batch to fit. ``max_num_seqs``: the engine's cap on
      sequences in flight.
    - ``rollout_sleep``: a colocated engine frees its memory after generating and takes it back before
      the next rollout [``free_cache_engine``]; its weights travel over the host link both ways.
    - ``enforce_eager``: the engine decodes without CUDA graphs [``enforce_eager``]: every layer's kernels
      are launched from Python at every step.
    """

    lengths: LengthDistribution | None = None
    padding: bool = False
    mini_batch_size: int | None = None
    epochs: int = 1
    train_tokens_per_gpu: int | None = None
    forward_tokens_per_gpu: int | None = None
    offload: tuple[tuple[str, Offload], ...] = ()
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 1024
    rollout_sleep: bool = False
    enforce_eager: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        owner = "RunSettings"
        if isinstance(self.offload, Mapping):
            object.__setattr__(self, "offload", tuple(sorted(self.offload.items())))
        for name in ("mini_batch_size", "train_tokens_per_gpu", "forward_tokens_per_gpu"):
            _positive_int(owner, name, getattr(self, name))
        _positive_int(owner, "epochs", self.epochs, allow_none=False)
        _positive_int(owner, "max_num_seqs", self.max_num_seqs, allow_none=False)
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"{owner}.gpu_memory_utilization={util!r} must be in (0, 1], e.g. 0.6")
        for role, value in self.offload:
            if not isinstance(value, Offload):
                raise TypeError(f"{owner}.offload[{role!r}] must be an Offload(params=..., grads=..., optimizer=...)")
        if self.lengths is not None and not isinstance(self.lengths, LengthDistribution):
            raise TypeError(f"{owner}.lengths must be a LengthDistribution, got {type(self.lengths).__name__}")

    def offload_of(self, role: str) -> Offload:
        """A role's offload; a detached rollout (``actor:rollout``) holds no trainer state to offload."""
        for name, value in self.offload:
            if name == role:
                return value
        return NO_OFFLOAD

    def response_lengths(self, mean_len: int) -> LengthDistribution:
        return self.lengths if self.lengths is not None else LengthDistribution.point(mean_len)


DEFAULT_SETTINGS = RunSettings()
