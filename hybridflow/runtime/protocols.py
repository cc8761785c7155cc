"""The backend contract: what a role engine and a backend must provide to the runtime.

A *backend* (torch reference, FSDP, DeepSpeed, vLLM...) is a module registered under the
``hybridflow.backends`` entry-point group that exposes ``BACKEND``, an object satisfying
:class:`Backend`. For each role placed on a worker, the worker asks the backend named by the
role's :class:`RoleSpec` for an engine built from the spec, the role's
:class:`~hybridflow.planner.RoleLayout` and a :class:`WorkerContext`, and the :class:`RolloutFactory`
the spec's ``rollout`` names (registry ``ROLLOUTS``, entry-point group ``hybridflow.rollouts``) turns it
into the engine the role runs: itself, or a hybrid that generates on another engine.

An engine is an :class:`Engine` (it can be closed) plus the *capabilities* its role needs in the
graph, one small protocol per op: :class:`Generator` (generate), :class:`LogProbModel` (logprob,
ref_logprob), :class:`ValueModel` (values), :class:`RewardModel` (score), :class:`Trainer` (update,
checkpoints), and for a policy whose rollout runs on GPUs of its own :class:`WeightSource` (the
trainer) and :class:`WeightSink` (the rollout). :data:`OP_CAPABILITIES` is that table; the controller
checks every engine against it once the engines are built, naming the role, the op and what is missing.

Engines see port names only (``prompts``, ``responses``...): the runtime renames graph fields to
ports before the call and back after it, so engines never know the graph. Batches crossing this
contract are :class:`~hybridflow.runtime.batch.Batch` objects holding this rank's rows. Token layout:
``prompts`` (B, P) left-padded with ``prompt_mask`` (B, P); ``responses`` / ``response_mask`` (B, T)
right-padded, with an optional ``loss_mask`` (B, T) inside ``response_mask`` (see :class:`Generator`);
per-token outputs (B, T) aligned with ``responses``; sequence outputs (B,).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from hybridflow.graph import DEFAULT_MAX_NEW_TOKENS, Op, RoleKind

if TYPE_CHECKING:
    import torch

    from hybridflow.agents.protocols import TurnRequest, TurnResult
    from hybridflow.planner import LayoutSupport, RoleLayout
    from hybridflow.runtime.batch import Batch

T = TypeVar("T")

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""``loss(outputs={...}, batch={...}, **options) -> (scalar loss, {name: scalar metric})``."""


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

    ``lora``: train LoRA adapters over the frozen model (trainable policies only). ``shares_policy``: a frozen
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
    shares_policy: str | None = None
    serves_adapter: AdapterSpec | None = None
    policy_versions: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RoleKind(self.kind))
        if self.lora is not None and self.kind is not RoleKind.POLICY:
            raise ValueError(f"role {self.name!r} ({self.kind}): lora (config key 'roles.{self.name}.lora') "
                             "trains adapters on a trainable policy only; remove it here")
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
    temperature: float = 1.0
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
class AsyncSum(Protocol):
    """A collective that can start an in-place sum over its ranks and return at once (a process group's):
    ``start_sum(tensor).wait()`` completes it. Engines overlap gradient reduction with the backward through it;
    every rank must start the same tensors in the same order."""

    def start_sum(self, tensor: torch.Tensor) -> Any: ...


@runtime_checkable
class Engine(Protocol):
    """What every role engine provides: a way to give its resources back (engines, processes, memory)."""

    def close(self) -> None:
        """Release everything the engine holds; called once, when the run ends or fails."""
        ...


@runtime_checkable
class Generator(Protocol):
    """The ``generate`` op."""

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """``prompts``, ``prompt_mask`` -> ``responses``, ``response_mask``: one sample per row, EOS-stopped.

        ``response_mask`` (B, T) marks the tokens of the sequence (attention, length, decoding). An engine may
        also return ``loss_mask`` (B, T), a subset of it: the tokens the policy sampled and is trained on. A
        multi-turn rollout writes the whole trajectory as one response and sets ``loss_mask`` to 0 on the tokens
        it did not sample (tool outputs, observations, chat-template tokens); an engine that returns none means
        every response token, and the worker fills ``loss_mask`` from ``response_mask``.

        With ``sampling.logprobs`` also ``rollout_logprobs`` (B, T) float32, aligned with ``responses`` and 0
        where ``loss_mask`` is 0 (a token the policy did not sample has no behaviour log-prob; the worker zeroes
        any the engine left there): each sampled token's log-prob under the trainer's definition (the
        log-softmax of the raw logits, as ``log_probs`` computes it; no temperature, top-k or top-p), so that
        on the same weights it equals the ``logprob`` op's value up to float noise.
        """
        ...


GenerateBatch = Callable[[Sequence["TurnRequest"]], "list[TurnResult]"]
"""Samples one batch of agent turns (:mod:`hybridflow.agents`): token ids in, sampled tokens and log-probs out."""


@runtime_checkable
class TurnGenerator(Protocol):
    """What a multi-turn ``generate`` (``environment=``) needs of a rollout engine besides :class:`Generator`."""

    def turn_session(self, sampling: SamplingParams) -> contextlib.AbstractContextManager[GenerateBatch]:
        """A context in which the returned function samples batches of turns under ``sampling`` (temperature,
        top-p/k, greedy; each request's own seed and token budget). It may be called from another thread, any
        number of times, and each rank of a sharded engine a different number of times: an engine gathers what
        it must when the session opens. Log-probs follow ``rollout_logprobs``' definition (raw logits)."""
        ...


@runtime_checkable
class LogProbModel(Protocol):
    """The ``logprob`` and ``ref_logprob`` ops."""

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        """``prompts``, ``prompt_mask``, ``responses``, ``response_mask`` -> ``logprobs`` (and ``entropy``)."""
        ...


@runtime_checkable
class AdapterModel(Protocol):
    """A policy trainer with LoRA adapters (``RoleSpec.lora``): its base model for free, its adapters alone.

    Its :class:`WeightSource` stream is the merged weights (base + scale * B @ A, HF names), so every whole-weight
    consumer works unchanged; these methods serve consumers that take adapters (peft format). Training engines
    have them whether or not they train adapters (``has_adapters`` says which; without adapters the two adapter
    methods raise), so :func:`capabilities_of` reports it only for an engine whose ``has_adapters`` is true.
    """

    has_adapters: bool

    def log_probs(self, batch: Batch, *, with_entropy: bool = False, adapters: bool = True) -> Batch:
        """:meth:`LogProbModel.log_probs`; ``adapters=False`` computes them under the base model (adapters off)."""
        ...

    def iter_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft state-dict name, whole tensor) of every adapter weight, as ``adapter_model.safetensors`` holds
        them. A collective for sharded engines: every rank drains it."""
        ...

    def adapter_config(self) -> dict[str, Any]:
        """peft's ``adapter_config.json`` content for these adapters (JSON-serialisable)."""
        ...


@runtime_checkable
class ValueModel(Protocol):
    """The ``values`` op of a critic."""

    def values(self, batch: Batch) -> Batch:
        """Per-token critic values -> ``values`` (B, T)."""
        ...


@runtime_checkable
class RewardModel(Protocol):
    """The ``score`` op of a reward model on GPUs (reward functions run on the driver: :class:`Scorer`)."""

    def score(self, batch: Batch) -> Batch:
        """Scores of whole sequences -> ``scores`` (B,)."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """The ``update`` op, and the checkpoints of what it trains."""

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        """One update over ``batch`` (epochs x mini batches x micro batches), gradients averaged
        over the group through the context's collective; returns mean scalar metrics.

        Raises :class:`~hybridflow.runtime.errors.NonFiniteLossError` before stepping on a NaN/inf loss.
        """
        ...

    def save_checkpoint(self, directory: str) -> None:
        """Weights and optimizer state into ``directory`` (every rank is called; formats are the backend's)."""
        ...

    def load_checkpoint(self, directory: str) -> None:
        ...


@runtime_checkable
class WeightSource(Protocol):
    """A trainer whose whole weights can leave it (for its rollout on other GPUs, or an export)."""

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) one at a time. A collective for sharded engines: every rank drains it."""
        ...

    def tied_weights(self) -> Mapping[str, str]:
        """``{alias: name}`` for weights held twice under two names (a tied ``lm_head``), so one copy travels."""
        ...


@runtime_checkable
class WeightSink(Protocol):
    """An engine that takes whole weights from elsewhere (a detached rollout)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with HF-named whole tensors (consumed one at a time)."""
        ...


@runtime_checkable
class AdapterSink(Protocol):
    """A rollout engine that takes LoRA adapters over a base it loaded once (vLLM with ``enable_lora``).

    An engine class may have the method whether or not it was started to take adapters: ``takes_adapters`` says,
    and :func:`capabilities_of` reports the protocol only when it is true.
    """

    takes_adapters: bool

    def load_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> None:
        """A new adapter version: peft-named whole tensors (``adapter_model.safetensors``) and peft's
        ``adapter_config.json`` content. Generations started before it finish under the version they began with."""
        ...


OP_CAPABILITIES: Mapping[Op, type] = {Op.GENERATE: Generator, Op.LOGPROB: LogProbModel,
                                      Op.REF_LOGPROB: LogProbModel, Op.VALUES: ValueModel, Op.SCORE: RewardModel,
                                      Op.UPDATE: Trainer}
"""The capability an engine needs for each op its role runs on a worker."""


class Backend(Protocol):
    """A factory of role engines; a backend module exposes one as ``BACKEND``.

    ``support`` declares the layouts its engines run as planned: the planner searches only those, and the
    controller refuses a plan that asks for more before any engine is built.
    """

    name: str
    support: LayoutSupport

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> Engine:
        """The role's own engine; the runtime then hands it to the spec's :class:`RolloutFactory`
        (:func:`hybridflow.runtime.engines.build_engine`)."""
        ...


@runtime_checkable
class RolloutFactory(Protocol):
    """How a policy generates: an entry of ``hybridflow.registry.ROLLOUTS``, named by ``RoleSpec.rollout``.

    ``standalone`` says whether the factory builds a frozen policy's engine by itself: then a detached
    rollout (``actor:rollout``) of a policy with this rollout is built with ``trainer=None`` and no backend
    loads a model for it (vLLM); otherwise the role's backend builds the frozen copy and the factory gets it
    as ``trainer`` (``native``, ``hf_generate``).
    """

    standalone: bool

    def build(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, *,
              trainer: Engine | None) -> Engine:
        """The engine the role runs.

        With ``trainer`` (the engine ``spec.backend`` built: a policy's trainer, or a frozen copy): it, or a
        wrapper that generates another way and leaves every other op to it (a hybrid engine). Without
        (a standalone frozen policy, e.g. a detached rollout): an engine that is a :class:`Generator` and a
        :class:`WeightSink`. Parses ``spec.rollout_options`` and refuses those it does not take.
        """
        ...


@runtime_checkable
class NodeState(Protocol):
    """What a stateful driver function keeps across steps (e.g. an adaptive KL coefficient).

    A compute function that needs one has a ``make_state(**node_options)`` attribute returning a
    ``NodeState`` (or None); the controller makes it once, passes it as ``state=`` every step, logs its
    metrics under the node's name and keeps it in checkpoints.
    """

    def metrics(self) -> dict[str, float]:
        ...

    def state_dict(self) -> dict[str, float]:
        ...

    def load_state_dict(self, state: dict[str, float]) -> None:
        ...


class Scorer(Protocol):
    """A driver-side reward: scores decoded samples in the controller process (reward functions)."""

    def __call__(self, batch: Batch) -> Batch:
        """``prompts``, ``responses``, ``response_mask``, ``ground_truth`` -> ``scores`` (B,)."""
        ...


CAPABILITIES: tuple[type, ...] = (Engine, Generator, TurnGenerator, LogProbModel, ValueModel, RewardModel, Trainer,
                                  WeightSource, WeightSink)


def capabilities_of(engine: object) -> frozenset[str]:
    """The names of the capability protocols ``engine`` satisfies (what a worker reports for its roles), with
    :class:`AdapterModel` and :class:`AdapterSink` where the engine has adapters or takes them."""
    names = {cap.__name__ for cap in CAPABILITIES if isinstance(engine, cap)}
    if isinstance(engine, AdapterModel) and engine.has_adapters:
        names.add(AdapterModel.__name__)
    if isinstance(engine, AdapterSink) and engine.takes_adapters:
        names.add(AdapterSink.__name__)
    return frozenset(names)


def parse_options(cls: type[T], options: Mapping[str, Any], *, role: str, owner: str) -> T:
    """``options`` as the typed dataclass ``cls``; an unknown key is refused with the list of valid ones."""
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"role {role!r}: unknown {owner} option(s) {unknown}; valid options are {valid}")
    return cls(**options)
