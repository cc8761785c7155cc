"""What a role is, as the runtime builds it: :class:`RoleSpec` (model, backend, rollout, options), its optimiser
(:class:`OptimSpec`) and LoRA adapter (:class:`AdapterSpec`), the rollout's :class:`SamplingParams`, and
:func:`parse_options` for a backend's typed options. The contracts engines and backends meet are in
:mod:`hybridflow.runtime.protocols`, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridflow.graph import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, RoleKind

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class OptimSpec:
    """How a trainable role is optimised. ``mini_batches`` splits one update into optimizer steps.

    The learning rate follows ``lr_scheduler`` over the run's updates (one per training step, as verl counts
    them; every mini batch and epoch of an update shares its rate): ``constant``, ``linear`` (to 0 at the last
    update) or ``cosine`` (to ``min_lr_ratio`` x ``lr``), each after a linear warmup over ``warmup_steps``
    updates (or ``warmup_ratio`` of them, rounded up), as transformers' schedules define them: update ``k``
    (0-based) trains at ``lr * lr_factor(k)``. ``total_steps`` is the schedule's length, set by the run to its
    ``steps``; 0 (a spec built by hand) is only valid with a constant schedule.
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    epochs: int = 1
    mini_batches: int = 1
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    total_steps: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimSpec.lr={self.lr} must be > 0")
        for name in ("epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"OptimSpec.{name}={getattr(self, name)} must be >= 1")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"OptimSpec.lr_scheduler={self.lr_scheduler!r} must be one of {list(LR_SCHEDULERS)}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError(f"OptimSpec.warmup_steps={self.warmup_steps} and total_steps={self.total_steps} must "
                             "be >= 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"OptimSpec.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.warmup_ratio and self.warmup_steps:
            raise ValueError("OptimSpec.warmup_steps and warmup_ratio both set: give one (ratio: a share of the "
                             "run's steps)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimSpec.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.min_lr_ratio and self.lr_scheduler != "cosine":
            raise ValueError(f"OptimSpec.min_lr_ratio={self.min_lr_ratio} is the floor of the cosine schedule; "
                             f"lr_scheduler is {self.lr_scheduler!r}")
        if self.total_steps == 0 and (self.lr_scheduler != "constant" or self.warmup_ratio):
            raise ValueError(f"OptimSpec.lr_scheduler={self.lr_scheduler!r} (or warmup_ratio) needs total_steps, "
                             "the updates the schedule spans")

    @property
    def warmup(self) -> int:
        """Warmup updates: ``warmup_steps``, or ``ceil(warmup_ratio * total_steps)`` (transformers' rounding)."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * self.total_steps)

    def lr_factor(self, update: int) -> float:
        """The multiple of ``lr`` that update ``update`` (0-based) trains at; transformers' ``get_*_schedule_with
        _warmup`` lambdas (cosine with ``min_lr_ratio`` as ``cosine_with_min_lr``)."""
        warmup = self.warmup
        if update < warmup:
            return update / max(1, warmup)
        if self.lr_scheduler == "constant":
            return 1.0
        progress = (update - warmup) / max(1, self.total_steps - warmup)
        if self.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        cosine = max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


LR_SCHEDULERS = ("constant", "linear", "cosine")


ADAPTER_INITS = ("default", "gaussian", "pissa", "olora")
"""The LoRA initialisations a role may ask for (peft's ``init_lora_weights``; ``default`` is peft's own: Kaiming A,
zero B). ``pissa`` and ``olora`` move the principal part of each base weight into the adapter at load."""


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """LoRA adapters on a trainable policy (``roles.<name>.lora``): only they train and checkpoint.

    ``rank`` r and ``alpha`` scale each update as alpha / r; ``dropout`` on the adapters' input;
    ``target_modules`` the linear modules to adapt (names, matched as suffixes of module paths, or
    ``all-linear``: every linear layer but the output head); ``init`` one of :data:`ADAPTER_INITS`.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    init: str = "default"

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 1")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, str) and targets != "all-linear":
            raise ValueError(f"lora.target_modules={targets!r} must be 'all-linear' or a list of module names "
                             "(e.g. [q_proj, v_proj])")
        if isinstance(targets, tuple) and (not targets or not all(isinstance(t, str) and t for t in targets)):
            raise ValueError(f"lora.target_modules={list(targets)!r} must list at least one module name")
        if self.init not in ADAPTER_INITS:
            raise ValueError(f"lora.init={self.init!r} must be one of {list(ADAPTER_INITS)}")

    @property
    def keeps_base(self) -> bool:
        """Whether the adapted model with adapters disabled is the base model (``pissa``/``olora`` change it)."""
        return self.init in ("default", "gaussian")


DEFAULT_ROLLOUT = "native"
"""The rollout a role has unless it names one: its trainer's own model generates."""


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """What to build for one role: the backend, its kind, the model to load and, if it trains, how.

    ``model`` is a local HF directory or a built-in tiny config name (``hybridflow.models``). How the role
    runs (micro batches, sharding, dtype...) is the plan's :class:`~hybridflow.planner.RoleLayout`, never
    the spec's. ``options`` are the backend's own, parsed
    by its typed options class (unknown keys are refused). ``rollout`` names the :class:`RolloutFactory`
    (``hybridflow.registry.ROLLOUTS``) of the engine a policy generates with, checked when the engine is
    built; ``rollout_options`` are that factory's own options (the vLLM engine's for ``"vllm"``).

    ``lora``: train LoRA adapters over the frozen model (trainable policies only); on a vision-language model they go
    on the language model, never the vision tower. ``freeze_vision_tower``: a trainable role's vision tower (a
    vision-language model's image encoder and its merger, as verl freezes it) gets no gradients and no optimizer state,
    and a weight sync to a rollout that loaded the same model skips it. ``shares_policy``: a frozen
    role that is that LoRA policy's base model (the same ``model``): where the plan puts both on one group,
    it runs on the policy's engine with adapters disabled and loads no model of its own (the planner's cue
    to cost it as no weights). ``serves_adapter``: a detached rollout of a LoRA policy (set by
    :func:`~hybridflow.runtime.placement.rollout_spec`): a rollout engine that takes adapters (vLLM) loads
    ``model`` once as the base and each update as a new adapter version; any other takes the merged weights.
    ``policy_versions``: how many versions of the policy's weights may be generating at once on this role's
    rollout, the execution mode's staleness bound k plus one (the controller sets it from its mode); a rollout
    that keeps versions loaded (vLLM's LoRA adapters) keeps at least this many.
    """

    name: str
    kind: RoleKind
    model: str
    backend: str = "torch"
    optim: OptimSpec | None = None
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    rollout: str = DEFAULT_ROLLOUT
    rollout_options: Mapping[str, Any] = field(default_factory=dict)
    lora: AdapterSpec | None = None
    freeze_vision_tower: bool = False
    shares_policy: str | None = None
    serves_adapter: AdapterSpec | None = None
    policy_versions: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RoleKind(self.kind))
        if self.lora is not None and self.kind is not RoleKind.POLICY:
            raise ValueError(f"role {self.name!r} ({self.kind}): lora trains adapters on a trainable policy "
                             "only; remove it here")
        if self.freeze_vision_tower and not self.kind.trainable:
            raise ValueError(f"role {self.name!r} ({self.kind}): freeze_vision_tower is for a trainable role; this one "
                             "trains nothing, remove it here")
        if self.shares_policy is not None and self.kind is not RoleKind.FROZEN_POLICY:
            raise ValueError(f"role {self.name!r} ({self.kind}): shares_policy is for a frozen policy (a reference)")
        if self.serves_adapter is not None and self.kind is not RoleKind.FROZEN_POLICY:
            raise ValueError(f"role {self.name!r} ({self.kind}): serves_adapter is for a frozen policy (a detached "
                             "rollout of a LoRA policy); a trainable policy trains its own (lora)")
        if isinstance(self.policy_versions, bool) or not isinstance(self.policy_versions, int) \
                or self.policy_versions < 1:
            raise ValueError(f"role {self.name!r}: policy_versions={self.policy_versions!r} must be an integer >= 1 "
                             "(the staleness bound k plus one)")
        if self.kind.trainable and self.optim is None:
            object.__setattr__(self, "optim", OptimSpec())
        if not self.rollout:
            raise ValueError(f"role {self.name!r}: rollout must name a rollout engine (default 'native')")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Rollout options of a generate node. ``greedy`` overrides temperature/top-p/top-k. ``logprobs`` asks for
    each sampled token's behaviour log-prob too (``rollout_logprobs``, see :class:`Generator`)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    logprobs: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be > 0 (or set greedy=True)")

    def rank_seed(self, rank: int) -> int:
        """The seed of one rank's generate call: ranks and steps sample differently, reruns the same."""
        return self.seed * 1009 + rank


def parse_options(cls: type[T], options: Mapping[str, Any], *, role: str, owner: str) -> T:
    """``options`` as the typed dataclass ``cls``; an unknown key is refused with the list of valid ones."""
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"role {role!r}: unknown {owner} option(s) {unknown}; valid options are {valid}")
    return cls(**options)
