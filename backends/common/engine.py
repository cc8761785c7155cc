"""The template every training backend's role engine follows: one construction path, one pass sequence.

A training engine (torch, FSDP, DeepSpeed) is a :class:`TrainingEngine`. The base owns what they all do, in this
order: refuse what the backend cannot run, parse the role's options, read the layout's batching, join the process
group, load the Hugging Face model (adapters, activation checkpointing), wrap it, build the optimizer of a trainable
role or freeze the others, then run the shared passes (``ForwardOps``: generate and the forward ops,
``GradientSteps``: the update loop, ``WeightStreams``: whole and adapter weights, checkpoints with the learning-rate
schedule). A backend fills in the hooks, each one pass of that sequence:

- build: :meth:`~TrainingEngine.check_runnable`, :meth:`~TrainingEngine.join_group`,
  :meth:`~TrainingEngine.load_dtype`, :meth:`~TrainingEngine.wrap_model` (placement, sharding, and the parts kept in
  host memory: ``offloaded``, FSDP2's ``CPUOffloadPolicy`` or ZeRO-Offload, set as the model is wrapped),
  :meth:`~TrainingEngine.build_optimizer`;
- forward: ``whole_weights`` (generation's gather, ``ForwardOps``) and ``training_module``;
- backward and step: :meth:`~TrainingEngine.zero_grad`, ``backward``, :meth:`~TrainingEngine.optimizer_step`;
- state dict: :meth:`~TrainingEngine.whole_state`, :meth:`~TrainingEngine.state_dict`,
  :meth:`~TrainingEngine.write_whole_state`, :meth:`~TrainingEngine.save_state`, :meth:`~TrainingEngine.load_state`;
- release: :meth:`~TrainingEngine.close`.

The runtime sees the contract of ``hybridflow.runtime.protocols`` only (an ``Engine`` with its capabilities); this
class is how the in-tree training backends meet it, not a second contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from hybridflow.backends.common import modeling, peft_lora
from hybridflow.backends.common.forward import ForwardOps
from hybridflow.backends.common.training import GradientSteps
from hybridflow.backends.common.weight_streams import WeightStreams

from hybridflow.planner import LayoutSupport, RoleLayout
from hybridflow.runtime.protocols import OptimSpec, RoleSpec, WorkerContext


class TrainingEngine(ForwardOps, GradientSteps, WeightStreams, ABC):
    """A role engine over a Hugging Face model: the shared construction (:meth:`__init__`) and passes, with the
    backend's steps as abstract hooks (module docstring).

    ``options_type`` parses ``RoleSpec.options`` (``from_spec(spec)``, refusing unknown keys); the parsed value is
    ``self.options``. ``optimizer``: what :meth:`build_optimizer` returned (None for a frozen role, and where the
backend's own engine holds and steps the optimizer, as DeepSpeed's does).
    """

    options_type: ClassVar[Any]
    optimizer: Any = None

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> None:
        self.spec, self.context = spec, context
        self.check_runnable(layout)
        self.options = self.options_type.from_spec(spec)
        self.micro_batch_size = layout.micro_batch_size
        self.forward_batch_size = layout.forward_micro_batch_size or self.micro_batch_size
        self.rollout_batch_size = layout.rollout_batch_size
        self.padding = layout.padding
        self.max_tokens = layout.max_tokens_per_micro_batch
        self.forward_max_tokens = layout.forward_max_tokens_per_micro_batch
        try:
            self.join_group()
            self._build(layout)
        except BaseException:
            self.close()  # whatever a failed build holds (DeepSpeed's hooks, LOCAL_RANK)
            raise

    def _build(self, layout: RoleLayout) -> None:
        spec = self.spec
        model = modeling.load_model(spec.kind, spec.model, dtype=self.load_dtype(layout), seed=spec.seed,
                                    lora=spec.lora, role=spec.name)
        self.adapter_layers = peft_lora.lora_layers(model)
        if spec.freeze_vision_tower:  # before the optimizer and any wrapping: neither sees the tower as trainable
            self.frozen_prefixes = (modeling.freeze_vision_tower(model, role=spec.name, source=spec.model) + ".",)
        if layout.gradient_checkpointing and spec.kind.trainable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = self.wrap_model(model, layout)
        if spec.kind.trainable:
            self.optimizer = self.build_optimizer(spec.optim or OptimSpec())
        else:
            self.model.requires_grad_(False)
        self.model.eval()  # tiny configs have no dropout; eval keeps HF from sampling any

    def check_runnable(self, layout: RoleLayout) -> None:
        """Refuse what this backend cannot run (a layout field, a missing dependency) before anything is joined or
        loaded; the error names the field and the fix. Default: everything runs."""

    def join_group(self) -> None:
        """Join the collective the engine's passes run over (torch.distributed); called inside the build, so a
        failure releases what was taken (:meth:`close`). Default: nothing (the context's collective suffices)."""

    def load_dtype(self, layout: RoleLayout) -> str:
        """The dtype the model loads in (a plan dtype name); default the layout's."""
        return layout.dtype

    @abstractmethod
    def wrap_model(self, model: torch.nn.Module, layout: RoleLayout) -> Any:
        """Place ``model`` (on the context's device, sharded, wrapped) as the layout says and return the module the
        forward ops run (``self.model``); sets ``offloaded``, the parts kept in host memory, when it offloads.
        A frozen role's parameters are set not to require gradients after it returns."""

    @abstractmethod
    def build_optimizer(self, optim: OptimSpec) -> Any:
        """The optimizer of a trainable role over ``self.model``'s trainable parameters, called after
        :meth:`wrap_model` for trainable roles only (None where the wrapped engine built its own)."""

    def training_module(self) -> Any:
        return self.model

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear the gradients before a mini batch's first backward."""

    @abstractmethod
    def optimizer_step(self, finite: bool, optim: OptimSpec) -> dict[str, float]:
        """Make every rank agree on ``finite`` (raising ``training.non_finite`` when one saw a bad loss), clip and
        step; returns ``grad_norm``/``lr`` metrics."""

    @abstractmethod
    def whole_state(self, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """(model state-dict name, whole tensor) of the entries ``keep`` accepts, one at a time."""

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights, owned by the caller (never aliasing the live parameters)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A sync's weights: those named (a sync leaves out a frozen vision tower, which keeps its values)."""
        self.refuse_whole_weights()
        self.write_whole_state(dict(named), partial=True)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Whole weights (the same on every rank, as :meth:`state_dict` gives them) into the model; refused for a
        LoRA policy, whose weights are a base and adapters."""
        self.refuse_whole_weights()
        self.write_whole_state(state)

    @abstractmethod
    def write_whole_state(self, state: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
        """Copy whole weights into the live model (each rank keeping its shard, where sharded); a name the model
        lacks is refused, and so is one missing from ``state`` unless ``partial`` (those keep their values)."""

    def save_checkpoint(self, directory: str) -> None:
        """The role's weights and optimizer states in the backend's format, and the schedule's position."""
        self.save_state(directory)
        if self.spec.kind.trainable:
            self.save_schedule(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.load_state(directory)
        if self.spec.kind.trainable:
            self.load_schedule(directory)

    @abstractmethod
    def save_state(self, directory: str) -> None:
        """Weights (a LoRA policy's adapters alone) and optimizer states into ``directory`` (every rank is called)."""

    @abstractmethod
    def load_state(self, directory: str) -> None:
        """What :meth:`save_state` wrote, with an error naming the file and the fix when it is truncated or corrupt."""

    def close(self) -> None:
        """Release what the engine holds; default nothing (the model and optimizer are plain memory)."""


class TrainingBackend:
    """A training backend's ``BACKEND`` (:class:`~hybridflow.runtime.protocols.Backend`): its ``name``, the layouts
    its engines run (``support``) and ``engine_type``, the :class:`TrainingEngine` it builds for every role; the
    runtime applies the spec's rollout to that engine (``runtime.engines``)."""

    name: str
    support: LayoutSupport
    engine_type: ClassVar[type[TrainingEngine]]

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> TrainingEngine:
        return self.engine_type(spec, layout, context)


def adamw(params: list[torch.nn.Parameter], optim: OptimSpec, *, fused: bool | None = None) -> torch.optim.AdamW:
    """torch's AdamW over ``params`` with the role's learning rate, betas and weight decay."""
    return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=fused)
