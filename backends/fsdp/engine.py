"""The FSDP2 role engine: one rank of a data-parallel group sharding a Hugging Face model with ``fully_shard``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hybridflow.backends.common.distributed import all_ranks_finite, all_ranks_max, all_ranks_sum, ensure_process_group
from hybridflow.backends.common.engine import TrainingBackend, TrainingEngine, adamw
from hybridflow.backends.common.training import clip_and_step, non_finite, trainable_parameters
from hybridflow.backends.fsdp import checkpoint, parallelize, tensor_parallel

from hybridflow.planner import LayoutSupport, RoleLayout, Sharding
from hybridflow.planner.plan import OFFLOAD_PARTS
from hybridflow.runtime.protocols import OptimSpec, RoleSpec, parse_options


@dataclass(frozen=True, kw_only=True)
class FsdpOptions:
    """Role options (``RoleSpec.options``) of the FSDP backend; any other key is refused.

    ``init_method``/``timeout_s``: how to join torch.distributed when nobody did (see ``common.distributed``).
    The HYBRID_SHARD group size is the plan's (``RoleLayout.shard_size``), not an option.
    """

    init_method: str | None = None
    timeout_s: float = 300.0

    @classmethod
    def from_spec(cls, spec: RoleSpec) -> FsdpOptions:
        if "shard_size" in spec.options:
            raise ValueError(f"role {spec.name!r}: fsdp option 'shard_size' moved to the plan: the layout's shard_size "
                             "(a manual mapping's fsdp_size, verl's fsdp_size); drop the option")
        return parse_options(cls, spec.options, role=spec.name, owner="fsdp backend")


class FsdpRoleEngine(TrainingEngine):
    """A role engine over an FSDP2-sharded HF model.

    Every rank of the group must call the same ops with the same number of rows (the controller pads
    rows to a multiple of ``dp``): forward passes all-gather parameters collectively.
    """

    options_type = FsdpOptions
    optimizer: torch.optim.Optimizer | None = None

    def check_runnable(self, layout: RoleLayout) -> None:
        if self.context.world_size % layout.tp:
            raise ValueError(f"RoleLayout({self.spec.name}).tp={layout.tp} must divide the group's "
                             f"{self.context.world_size} ranks (dp x tp of them)")

    def join_group(self) -> None:
        ensure_process_group(self.context, self.spec.options, role=self.spec.name)

    def load_dtype(self, layout: RoleLayout) -> str:
        # Trainable roles keep fp32 master weights and compute in layout.dtype; frozen ones load in it.
        return "fp32" if self.spec.kind.trainable else layout.dtype

    def wrap_model(self, model: torch.nn.Module, layout: RoleLayout) -> Any:
        context = self.context
        model.to(context.device)
        self.tensor_parallel = layout.tp
        device_type = torch.device(context.device).type
        self.setup = parallelize.resolve_sharding(layout.sharding, world_size=context.world_size // layout.tp,
                                                  shard_size=layout.shard_size, tp=layout.tp)
        self.offloaded = layout.offloaded
        self.offload_policy = parallelize.offload_policy(layout.offloaded, device_type=device_type,
                                                         role=self.spec.name)
        return parallelize.shard_model(model, self.setup, device_type=device_type,
                                       param_dtype=layout.dtype if self.spec.kind.trainable else None, tp=layout.tp,
                                       offload=self.offload_policy, role=self.spec.name)

    def build_optimizer(self, optim: OptimSpec) -> torch.optim.Optimizer:
        # fused, as the torch backend's (one kernel over the shards, DTensors included): on a 25M-parameter
        # model's one-rank shards on a CPU thread 50 ms a step against 130 ms for the default per-tensor loop
        return adamw(trainable_parameters(self.model), optim, fused=True)

    def executed_sharding(self) -> str:
        return self.setup.strategy.value

    def executed_layout(self) -> dict[str, Any]:
        """The common report, and the offload as run: ``offload_policy`` names FSDP2's policy (``OffloadPolicy``,
        nothing moved, on a CPU device where every tensor is in host memory already)."""
        return {**super().executed_layout(), "offload_policy": type(self.offload_policy).__name__}

    @contextlib.contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Whole parameters on every rank for the duration (generation runs a data-dependent number of
        forward passes per rank, which per-forward all-gathers would deadlock on)."""
        modules = parallelize.fsdp_modules(self.model)
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
                # Blocks follow the strategy; the root never reshards after forward (see shard_model).
                keep = module is self.model or not self.setup.reshard_after_forward
                module.set_reshard_after_forward(not keep, recurse=False)

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def most_over_ranks(self, value: int) -> int:
        return all_ranks_max(value)  # every rank runs as many micro batches: each forward is a collective

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        # The default group: every rank of a tensor-parallel slice holds the same rows, so they count once.
        return [value / self.tensor_parallel for value in all_ranks_sum(values)]

    def data_parallel_ranks(self) -> int:
        return self.context.world_size // self.tensor_parallel  # the ranks FSDP averages gradients over

    def optimizer_step(self, finite: bool, optim: OptimSpec) -> dict[str, float]:
        assert self.optimizer is not None
        # Every rank votes, so a bad loss on one rank aborts the step everywhere instead of hanging a collective.
        if not all_ranks_finite(finite):
            self.optimizer.zero_grad(set_to_none=True)
            raise non_finite(self.spec.name)
        if self.tensor_parallel > 1:  # parameters on two meshes (data x tensor, data alone): one norm over both
            world = self.context.world_size
            return clip_and_step(self.spec.name, self.model, self.optimizer, optim.grad_clip, set_to_none=True,
                                 clip=lambda params, norm: tensor_parallel.clip_gradients(params, norm, world))
        return clip_and_step(self.spec.name, self.model, self.optimizer, optim.grad_clip, set_to_none=True,
                             whole=full_value)

    def whole_state(self, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) one parameter at a time: a collective, every rank must drain it in step.

        A consumer that copies each tensor away (a rollout engine) never holds more than one gathered
        parameter besides its own weights (a LoRA layer's merge: its base weight and adapters).
        """
        for name, tensor in self.model.state_dict().items():
            if keep(name):
                yield name, full_value(tensor).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights on the CPU, owned by the caller (never aliasing the live parameters)."""
        live = {local_value(tensor).data_ptr() for tensor in self.model.state_dict().values()}
        return {name: tensor.clone() if tensor.data_ptr() in live else tensor.cpu()
                for name, tensor in self.iter_full_weights()}

    def write_whole_state(self, state: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
        """Each rank keeps its own shard of the whole weights, without communication. The optimizer's moments are
        left as they are."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        live = self.model.state_dict()
        missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
        if unexpected or (missing and not partial):
            raise KeyError(f"role {self.spec.name!r}: load_state_dict is missing {missing[:5]} "
                           f"({len(missing)} of {len(live)} tensors), unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, value in live.items():
                if name not in state:
                    continue
                full = state[name].to(device=value.device, dtype=value.dtype)
                if isinstance(value, DTensor):
                    full = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None).to_local()
                    value = value.to_local()
                value.copy_(full)

    def save_state(self, directory: str) -> None:
        checkpoint.save(directory, self.model, self.optimizer, frozen=not self.has_adapters)

    def load_state(self, directory: str) -> None:
        checkpoint.load(directory, self.model, self.optimizer, frozen=not self.has_adapters)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor shard (a collective); plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FsdpBackend(TrainingBackend):
    """Builds :class:`FsdpRoleEngine` s; the runtime applies the spec's rollout to them (``runtime.engines``)."""

    engine_type = FsdpRoleEngine
    name = "fsdp"
    # ZeRO-1 (optimizer states only) has no FSDP2 equivalent: the nearest would shard gradients too. Tensor
    # parallelism: any tp dividing the heads (the planner's search only proposes those); offload: FSDP2's
    # CPUOffloadPolicy, which moves parameters, gradients and optimizer states together.
    support = LayoutSupport(backend="fsdp", shardings=frozenset({Sharding.NO_SHARD, Sharding.SHARD_GRAD_OP,
                                                                 Sharding.FULL_SHARD, Sharding.HYBRID_SHARD}),
                            max_tp=None, max_rollout_tp=None, rollout_follows_tp=True, gradient_checkpointing=True,
                            rollout_batch_size=True, packing=True, token_budgets=True,
                            offload=frozenset(OFFLOAD_PARTS), offload_sets=(frozenset(OFFLOAD_PARTS),),
                            notes={"sharding": "ZeRO stages run on backend deepspeed",
                                   "offload": "optimizer states alone (ZeRO-Offload) run on backend deepspeed"})


BACKEND = FsdpBackend()
