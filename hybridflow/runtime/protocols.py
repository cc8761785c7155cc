"""The backend contract: what a role engine and a backend must provide to the runtime.

A *backend* (torch reference, FSDP, DeepSpeed, vLLM...) is a module registered under the
``hybridflow.backends`` entry-point group that exposes ``BACKEND``, an object satisfying
:class:`Backend`. For each role placed on a worker, the worker asks the backend for a
:class:`RoleEngine` built from a :class:`RoleSpec`, the role's :class:`~hybridflow.planner.RoleLayout`
and a :class:`WorkerContext`. Engines see port names only (``prompts``, ``responses``...): the runtime
renames graph fields to ports before the call and back after it, so engines never know the graph.

Batches crossing this contract are :class:`~hybridflow.runtime.batch.Batch` objects holding this
rank's rows. Token layout: ``prompts`` (B, P) left-padded with ``prompt_mask`` (B, P);
``responses`` / ``response_mask`` (B, T) right-padded; per-token outputs (B, T) aligned with
``responses``; sequence outputs (B,).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hybridflow.graph import RoleKind

if TYPE_CHECKING:
    import torch

    from hybridflow.planner import RoleLayout
    from hybridflow.runtime.batch import Batch

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""``loss(outputs={...}, batch={...}, **options) -> (scalar loss, {name: scalar metric})``."""


@dataclass(frozen=True, kw_only=True)
class OptimSpec:
    """How a trainable role is optimised. ``mini_batches`` splits one update into optimizer steps."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    epochs: int = 1
    mini_batches: int = 1

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimSpec.lr={self.lr} must be > 0")
        for name in ("epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"OptimSpec.{name}={getattr(self, name)} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """What to build for one role: its kind, the model to load and, if it trains, how.

    ``model`` is a local HF directory or a built-in tiny config name (``hybridflow.models``).
    ``micro_batch_size`` of 0 takes the plan layout's value. ``options`` are backend-specific
    (the torch backend reads ``rollout``: ``"hf_generate"`` to sample with HF ``generate``).
    """

    name: str
    kind: RoleKind
    model: str
    optim: OptimSpec | None = None
    micro_batch_size: int = 0
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RoleKind(self.kind))
        if self.kind.trainable and self.optim is None:
            object.__setattr__(self, "optim", OptimSpec())


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Rollout options of a generate node. ``greedy`` overrides temperature/top-p/top-k."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be > 0 (or set greedy=True)")


class Collective(Protocol):
    """Data-parallel communication among the ranks of one worker group."""

    rank: int
    world_size: int

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` in place over the group's ranks (gradients, metrics)."""
        ...


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """Where an engine runs: its rank in the group, the device, and the group's collective."""

    group: int
    rank: int
    world_size: int
    device: str
    collective: Collective


@runtime_checkable
class RoleEngine(Protocol):
    """One role's model on one rank. Implement the ops the role's kind allows; the rest may raise."""

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """``prompts``, ``prompt_mask`` -> ``responses``, ``response_mask``: one sample per row, EOS-stopped."""
        ...

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        """``prompts``, ``prompt_mask``, ``responses``, ``response_mask`` -> ``logprobs`` (and ``entropy``)."""
        ...

    def values(self, batch: Batch) -> Batch:
        """Per-token critic values -> ``values`` (B, T)."""
        ...

    def score(self, batch: Batch) -> Batch:
        """Reward-model scores of whole sequences -> ``scores`` (B,)."""
        ...

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        """One update over ``batch`` (epochs x mini batches x micro batches), gradients averaged
        over the group through the context's collective; returns mean scalar metrics.

        Raises :class:`~hybridflow.runtime.errors.NonFiniteLossError` before stepping on a NaN/inf loss.
        """
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights, for weight sync to a rollout engine."""
        ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ...

    def save_checkpoint(self, directory: str) -> None:
        """Weights and optimizer state into ``directory`` (every rank is called; formats are the backend's)."""
        ...

    def load_checkpoint(self, directory: str) -> None:
        ...


class Backend(Protocol):
    """A factory of role engines; a backend module exposes one as ``BACKEND``."""

    name: str

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> RoleEngine:
        ...


class Scorer(Protocol):
    """A driver-side reward: scores decoded samples in the controller process (reward functions)."""

    def __call__(self, batch: Batch) -> Batch:
        """``prompts``, ``responses``, ``response_mask``, ``ground_truth`` -> ``scores`` (B,)."""
        ...
