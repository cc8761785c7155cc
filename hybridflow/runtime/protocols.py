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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hybridflow.graph import Op
from hybridflow.runtime.specs import ADAPTER_INITS as ADAPTER_INITS
from hybridflow.runtime.specs import DEFAULT_ROLLOUT as DEFAULT_ROLLOUT
from hybridflow.runtime.specs import LR_SCHEDULERS as LR_SCHEDULERS
from hybridflow.runtime.specs import AdapterSpec as AdapterSpec
from hybridflow.runtime.specs import OptimSpec as OptimSpec
from hybridflow.runtime.specs import RoleSpec as RoleSpec
from hybridflow.runtime.specs import SamplingParams as SamplingParams
from hybridflow.runtime.specs import parse_options as parse_options

if TYPE_CHECKING:
    import torch

    from hybridflow.agents.protocols import TurnRequest, TurnResult
    from hybridflow.planner import LayoutSupport, RoleLayout
    from hybridflow.runtime.batch import Batch

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""``loss(outputs={...}, batch={...}, **options) -> (scalar loss, {name: scalar metric})``."""


class Collective(Protocol):
    """Data-parallel communication among the ranks of one worker group."""

    rank: int
    world_size: int

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` in place over the group's ranks (gradients, metrics)."""
        ...

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank: what engines tell each other (a rollout
        fleet's router URL, a weight sync's outcome). Every rank must call it, in the same order."""
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
class TrainedWeightSource(Protocol):
    """A :class:`WeightSource` some of whose weights never train (a frozen vision tower): a sync to a rollout that
    loaded the same model sends the others alone (:func:`~hybridflow.runtime.weights.full_weights`)."""

    def iter_trained_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) of the weights that train, one at a time; a collective like
        :meth:`WeightSource.iter_full_weights`."""
        ...


@runtime_checkable
class WeightSink(Protocol):
    """An engine that takes whole weights from elsewhere (a detached rollout)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with HF-named whole tensors (consumed one at a time); weights not named
        keep their values (a sync leaves out a frozen vision tower: :class:`TrainedWeightSource`)."""
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
    metrics under the node's name and keeps it in checkpoints. A function whose ``reads_role_models`` attribute is
    True gets ``role_models`` too (role -> its model directory, where its tokenizer is): a judge's templates turn
    the policy's token ids into text and the judge's text into its own ids. A function that renders another
    generate's prompts may have a ``template_tokens(*, tokenizer, ground_truths, **node_options) -> int`` attribute:
    the tokens its rendering adds around a prompt and response, which the planner prices
    (``hybridflow.train.template_tokens``). A state may name its counts in a
    ``summed_metrics`` attribute: where a node runs on several partitions of a step (stream chunks), those add up
    over the step; its other metrics are a mean weighted by rows (:class:`~hybridflow.runtime.scheduler.StepRecord`).
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
