"""The DeepSpeed role engine: a Hugging Face model under ZeRO stage 0-3 on one rank of a group."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common import modeling
from hybridflow.backends.common.checkpoint_errors import LOAD_ERRORS, unloadable
from hybridflow.backends.common.distributed import all_ranks_finite, all_ranks_max, all_ranks_sum, ensure_process_group
from hybridflow.backends.common.engine import TrainingBackend, TrainingEngine, adamw
from hybridflow.backends.common.training import non_finite, trainable_parameters
from hybridflow.backends.deepspeed.config import DeepSpeedOptions, build_config, zero_stage

from hybridflow.planner import LayoutSupport, RoleLayout, Sharding
from hybridflow.planner.plan import OFFLOAD_PARTS
from hybridflow.runtime.protocols import OptimSpec

CHECKPOINT_TAG = "hybridflow"


_LOCAL_RANK_LOCK = threading.Lock()
_local_rank_holders = 0  # live engines that set LOCAL_RANK (in-process ranks are threads); the last one out removes it


def _hold_local_rank(rank: str) -> bool:
    """Set ``LOCAL_RANK`` for a new engine unless a launcher set it: DeepSpeed insists on one (at build and in
    ZeRO-3's hooks) and Ray and spawned ranks have none. True when the engine holds it, to release on close."""
    global _local_rank_holders
    with _LOCAL_RANK_LOCK:
        if _local_rank_holders == 0 and "LOCAL_RANK" in os.environ:
            return False  # a launcher's
        os.environ.setdefault("LOCAL_RANK", rank)
        _local_rank_holders += 1
        return True


def _release_local_rank() -> None:
    """The last engine holding ``LOCAL_RANK`` removes it: a leftover one makes later code in the process
    (transformers' TrainingArguments, for one) take it for a distributed launch and wait on a rendezvous."""
    global _local_rank_holders
    with _LOCAL_RANK_LOCK:
        _local_rank_holders -= 1
        if _local_rank_holders == 0:
            os.environ.pop("LOCAL_RANK", None)


def import_deepspeed() -> Any:
    """The ``deepspeed`` module, or an error saying which extra to install."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError("the deepspeed backend needs DeepSpeed: install the `deepspeed` extra "
                          "(`pip install hybridflow[deepspeed]`)") from err
    return deepspeed


class DeepSpeedRoleEngine(TrainingEngine):
    """A role engine over a DeepSpeed engine.

    Trainable roles run ``deepspeed.initialize`` with a torch AdamW (or DeepSpeed's CPU Adam under
    ZeRO-Offload); frozen roles are ZeRO-3 partitioned for inference at stage 3, plain modules below.
    """

    options_type = DeepSpeedOptions
    options: DeepSpeedOptions
    engine: Any = None  # DeepSpeed's engine; None for a frozen role below ZeRO-3
    _holds_local_rank = False

    def check_runnable(self, layout: RoleLayout) -> None:
        if layout.tp != 1:
            raise ValueError(f"RoleLayout({self.spec.name}).tp={layout.tp}: the deepspeed backend is data parallel "
                             "only; use tp=1")
        import_deepspeed()

    def join_group(self) -> None:
        context = self.context
        ensure_process_group(context, self.spec.options, role=self.spec.name)
        device = torch.device(context.device)
        self._holds_local_rank = _hold_local_rank(str(device.index or 0) if device.type == "cuda" else
                                                  str(context.rank))
        import_deepspeed().init_distributed(dist_backend="nccl" if context.device.startswith("cuda") else "gloo",
                                            dist_init_required=False)

    def load_dtype(self, layout: RoleLayout) -> str:
        return "fp32"  # DeepSpeed casts to the layout's dtype (its bf16/fp16 sections) and keeps fp32 masters

    def wrap_model(self, model: torch.nn.Module, layout: RoleLayout) -> Any:
        deepspeed, spec = import_deepspeed(), self.spec
        self.stage = zero_stage(layout)
        config = build_config(spec, layout, self.options, micro_batch_size=self.micro_batch_size,
                              pin_memory=torch.device(self.context.device).type == "cuda")
        zero = config["zero_optimization"]
        self.offloaded = frozenset(({"optimizer", "grads"} if "offload_optimizer" in zero else set())
                                   | ({"params"} if "offload_param" in zero else set()))
        if spec.kind.trainable:
            optimizer = None
            trainable = trainable_parameters(model)  # a LoRA policy's adapters alone
            if "optimizer" not in config:  # else ZeRO-Offload's CPU Adam, which DeepSpeed builds
                optimizer = adamw(trainable, spec.optim or OptimSpec())
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                   model_parameters=None if optimizer else trainable,
                                                   dist_init_required=False)
            return self.engine.module
        if self.stage == 3:
            model.requires_grad_(False)
            self.engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
            return self.engine.module
        return model.to(dtype=modeling.DTYPES[layout.dtype], device=self.context.device).requires_grad_(False)

    def build_optimizer(self, optim: OptimSpec) -> None:
        """None: the optimizer is DeepSpeed's engine's, built by ``deepspeed.initialize`` in :meth:`wrap_model` and
        stepped by ``engine.step()`` (:meth:`param_groups` reads it there)."""
        return None

    @contextlib.contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Whole parameters on every rank (ZeRO-3), for generation's data-dependent number of forwards."""
        if self.stage < 3:
            yield
            return
        with import_deepspeed().zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
            yield

    def executed_sharding(self) -> str:
        return f"ZERO{self.stage}" if self.stage else "NO_SHARD"

    def training_module(self) -> Any:
        return self.engine

    def zero_grad(self) -> None:
        return None  # ``engine.step()`` zeroes what it applied

    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.engine.optimizer.param_groups  # ZeRO's wrapper exposes the base groups
        return groups

    def most_over_ranks(self, value: int) -> int:
        return all_ranks_max(value)  # every rank runs as many micro batches: each forward is a collective

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        return all_ranks_sum(values)  # the default group: the ranks this engine shards and averages over

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, finite: bool, optim: OptimSpec) -> dict[str, float]:
        if not all_ranks_finite(finite):
            self.engine.zero_grad()
            raise non_finite(self.spec.name)
        self.engine.step()  # reduces, clips (gradient_clipping) and applies the accumulated micro batches
        metrics = {"lr": float(self.engine.get_lr()[0])}
        grad_norm = self.engine.get_global_grad_norm()  # None at ZeRO stage 0, which clips without reporting
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    def whole_state(self, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) one at a time; under ZeRO-3 each is gathered (a collective) then released."""
        for name, value in self.model.state_dict(keep_vars=True).items():
            if not keep(name):
                continue
            if self.stage == 3 and hasattr(value, "ds_id"):
                with import_deepspeed().zero.GatheredParameters([value], modifier_rank=None):
                    yield name, value.detach().clone()
            else:
                yield name, value.detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.cpu().clone() for name, tensor in self.iter_full_weights()}

    def write_whole_state(self, state: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
        """Whole weights into the module and the optimizer's fp32 copy."""
        deepspeed = import_deepspeed()
        live = self.model.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
        if unexpected or (missing and not partial):
            raise KeyError(f"role {self.spec.name!r}: the weights miss {missing[:5]} and name {unexpected[:5]} "
                           "that this model lacks")
        with torch.no_grad():
            for name, value in live.items():
                if name not in state:
                    continue
                context = (deepspeed.zero.GatheredParameters([value], modifier_rank=0)
                           if self.stage == 3 and hasattr(value, "ds_id") else contextlib.nullcontext())
                with context:
                    value.data.copy_(state[name].to(value.dtype))
        refresh = getattr(getattr(self.engine, "optimizer", None), "refresh_fp32_params", None)
        if refresh is not None:
            refresh()  # ZeRO keeps fp32 master partitions the step would write back

    def save_state(self, directory: str) -> None:
        """DeepSpeed's own layout: per-rank ZeRO shards of weights and optimizer states (a collective). A LoRA
        policy's frozen base is left out (its model directory's)."""
        if self.engine is None:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(directory, tag=CHECKPOINT_TAG, exclude_frozen_parameters=self.has_adapters)

    def load_state(self, directory: str) -> None:
        if self.engine is None:
            return
        try:
            path, _state = self.engine.load_checkpoint(directory, tag=CHECKPOINT_TAG,
                                                       load_module_strict=not self.has_adapters)
        except LOAD_ERRORS as err:  # a ZeRO shard or the model states truncated or garbled
            raise unloadable(directory, err, backend="deepspeed") from err
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint tagged {CHECKPOINT_TAG!r} in {directory!r}")

    def close(self) -> None:
        """Release DeepSpeed's hooks and partitioned buffers (``DeepSpeedEngine.destroy``), and ``LOCAL_RANK``."""
        if self.engine is not None:
            self.engine.destroy()
        if self._holds_local_rank:
            self._holds_local_rank = False
            _release_local_rank()


_SHARDED = frozenset({Sharding.ZERO1, Sharding.ZERO2, Sharding.SHARD_GRAD_OP, Sharding.ZERO3, Sharding.FULL_SHARD})


class DeepSpeedBackend(TrainingBackend):
    """Builds :class:`DeepSpeedRoleEngine` s; the runtime applies the spec's rollout to them (``runtime.engines``)."""

    engine_type = DeepSpeedRoleEngine
    name = "deepspeed"
    # HYBRID_SHARD would run as plain ZeRO-3 over the whole group (no replica groups): left out.
    support = LayoutSupport(
        backend="deepspeed", shardings=frozenset({Sharding.NO_SHARD, Sharding.ZERO1, Sharding.ZERO2,
                                                  Sharding.SHARD_GRAD_OP, Sharding.ZERO3, Sharding.FULL_SHARD}),
        gradient_checkpointing=True, rollout_batch_size=True, packing=True, token_budgets=True,
        offload=frozenset(OFFLOAD_PARTS),
        # ZeRO-Offload moves gradient partitions with the optimizer states; parameters go at ZeRO-3 only.
        offload_sets=tuple(frozenset(parts) for parts in (("optimizer",), ("grads", "optimizer"), ("params",),
                                                          ("params", "optimizer"), OFFLOAD_PARTS)),
        offload_shardings=(("params", frozenset({Sharding.ZERO3, Sharding.FULL_SHARD})),
                           ("optimizer", _SHARDED), ("grads", _SHARDED)),
        notes={"sharding": "HYBRID_SHARD runs on backend fsdp",
               "tp": "tensor parallelism runs on backend fsdp"})


BACKEND = DeepSpeedBackend()
