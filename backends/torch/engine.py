"""The torch reference role engine: one replica of a role's model per rank, gradients averaged."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common import peft_lora
from hybridflow.backends.common.engine import TrainingBackend, TrainingEngine, adamw
from hybridflow.backends.common.training import clip_and_step, non_finite, trainable_parameters

from hybridflow.planner import LayoutSupport, RoleLayout
from hybridflow.runtime.protocols import AsyncSum, OptimSpec, RoleSpec, parse_options


@dataclass(frozen=True, kw_only=True)
class TorchOptions:
    """Role options of the torch backend: none yet (the rollout engine is ``RoleSpec.rollout``)."""

    @classmethod
    def from_spec(cls, spec: RoleSpec) -> TorchOptions:
        return parse_options(cls, spec.options, role=spec.name, owner="torch backend")


class TorchRoleEngine(TrainingEngine):
    """A role engine over a Hugging Face module: generate, forward ops, training and weight transfer.

    Data parallel ranks each hold a full replica (DDP-like); ``layout.tp`` > 1 is for other backends.
    """

    options_type = TorchOptions
    optimizer: torch.optim.Optimizer | None = None
    flat_grads: torch.Tensor | None = None
    overlap: OverlappedReduce | None = None

    def check_runnable(self, layout: RoleLayout) -> None:
        if layout.tp != 1:
            raise ValueError(f"RoleLayout({self.spec.name}).tp={layout.tp}: the torch backend has no tensor "
                             "parallelism; use tp=1 or the fsdp/vllm backend")

    def wrap_model(self, model: torch.nn.Module, layout: RoleLayout) -> Any:
        return model.to(self.context.device)

    def build_optimizer(self, optim: OptimSpec) -> torch.optim.Optimizer:
        params = trainable_parameters(self.model)
        context = self.context
        if context.world_size > 1:
            self.flat_grads = flat_gradients(params)
            if self.flat_grads is not None and isinstance(context.collective, AsyncSum):
                self.overlap = OverlappedReduce(params, self.flat_grads[:-1], context.collective,
                                                world_size=context.world_size)
        # fused: one kernel over all parameters (CPU and CUDA since torch 2.4); on a 25M-parameter model on
        # one CPU thread 29 ms a step against 109 ms for the per-tensor loop, the default off CUDA
        return adamw(params, optim, fused=True)

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=False)

    def before_last_backward(self) -> None:
        if self.overlap is not None:
            self.overlap.arm()

    def optimizer_step(self, finite: bool, optim: OptimSpec) -> dict[str, float]:
        assert self.optimizer is not None
        # Every rank joins the same all-reduce even on a bad loss, so no rank is left waiting.
        if self.overlap is not None:  # buckets reduced during the last backward; the rest, then the flag
            assert self.flat_grads is not None
            self.overlap.finish()
            flag = self.flat_grads[-1:]
            flag.fill_(0.0 if finite else 1.0)
            self.context.collective.all_reduce_mean([flag])
        elif self.flat_grads is not None:  # the gradients and the flag in one buffer: reduced in place
            self.flat_grads[-1] = 0.0 if finite else 1.0
            self.context.collective.all_reduce_mean([self.flat_grads])
            flag = self.flat_grads[-1:]
        else:
            flag = torch.tensor([0.0 if finite else 1.0])
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.context.collective.all_reduce_mean([flag, *grads])
        if flag.item() > 0:
            self.optimizer.zero_grad(set_to_none=False)
            raise non_finite(self.spec.name)
        return clip_and_step(self.spec.name, self.model, self.optimizer, optim.grad_clip, set_to_none=False)

    def whole_state(self, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            if keep(name):
                yield name, tensor.detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights, owned by the caller (never aliasing the live parameters)."""
        return {name: tensor.clone() for name, tensor in self.iter_full_weights()}

    def write_whole_state(self, state: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
        unexpected = self.model.load_state_dict(dict(state), strict=not partial).unexpected_keys
        if unexpected:
            raise KeyError(f"role {self.spec.name!r}: the weights name tensors this model lacks: {unexpected[:5]}")

    def save_state(self, directory: str) -> None:
        if self.context.rank != 0:  # replicas are identical: rank 0 writes for the group
            return
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        # A LoRA policy's base weights are its model directory's: only the adapters (and their moments) are saved.
        model = self.model.state_dict()
        if self.has_adapters:
            model = {name: tensor for name, tensor in model.items() if peft_lora.is_adapter_key(name)}
        state = {"model": model, "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        torch.save(state, path / "state.pt")

    def load_state(self, directory: str) -> None:
        file = Path(directory) / "state.pt"
        try:
            state = torch.load(file, map_location=self.context.device, weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError) as err:  # torch's reader: truncated or not a zip
            raise ValueError(f"{file} cannot be loaded ({str(err).splitlines()[0]}); it is truncated or corrupt: "
                             "resume from an older checkpoint (--resume-from checkpoints/step_N)") from err
        if self.has_adapters:
            peft_lora.load_adapter_state(self.model, state["model"], role=self.spec.name)
        else:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])


class TorchBackend(TrainingBackend):
    """Builds :class:`TorchRoleEngine` s; the runtime applies the spec's rollout to them (``runtime.engines``)."""

    engine_type = TorchRoleEngine
    name = "torch"
    support = LayoutSupport(backend="torch", gradient_checkpointing=True, rollout_batch_size=True, packing=True,
                            token_budgets=True,
                            notes={"sharding": "use backend fsdp or deepspeed to shard",
                                   "tp": "no training backend here has tensor parallelism"})


BACKEND = TorchBackend()


def flat_gradients(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """One fp32 buffer whose slices are ``params``' gradients (as DDP's ``gradient_as_bucket_view``), plus a last
    element for the step's finite flag, so the data-parallel all-reduce runs on it in place: no gather into a
    flat copy and back (a 25M-parameter model's 100 MB: ~70 ms of the ~150 ms the copying reduce took on
    2 CPU ranks). None when the parameters are not all fp32 on one device (reduced tensor by tensor)."""
    if not params or any(p.dtype != torch.float32 or p.device != params[0].device for p in params):
        return None
    flat = torch.zeros(sum(p.numel() for p in params) + 1, device=params[0].device)
    offset = 0
    for param in params:
        param.grad = flat[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    return flat


BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


class OverlappedReduce:
    """Gradient buckets summed over the ranks while the backward still runs (DDP's overlap): ``grads`` (a flat
    buffer of ``params``' gradients, in their order) cut into ~25 MB buckets from its end, the layers a backward
    reaches first. Armed before a mini-batch's last backward, each parameter's accumulated gradient counts towards
    its bucket, and complete buckets start in one fixed order (the tail first, never out of turn), so every rank
    issues the same collectives in the same order whatever order its hooks fire in; :meth:`finish` starts what
    is left (all of it on a rank that stopped at a non-finite loss), waits, and takes the mean."""

    def __init__(self, params: list[torch.nn.Parameter], grads: torch.Tensor, collective: AsyncSum, *,
                 world_size: int) -> None:
        self.grads, self.collective, self.world_size = grads, collective, world_size
        buckets: list[list[torch.nn.Parameter]] = [[]]
        elements = 0
        for param in reversed(params):  # the buffer's tail first
            if buckets[-1] and (elements + param.numel()) * grads.element_size() > BUCKET_BYTES:
                buckets.append([])
                elements = 0
            buckets[-1].append(param)
            elements += param.numel()
        self.bucket_of = {id(param): index for index, bucket in enumerate(buckets) for param in bucket}
        self.views: list[torch.Tensor] = []
        stop = grads.numel()
        for bucket in buckets:
            start = stop - sum(param.numel() for param in bucket)
            self.views.append(grads[start:stop])
            stop = start
        self.sizes = [len(bucket) for bucket in buckets]
        self.armed, self.left, self.started, self.overlapped = False, list(self.sizes), 0, 0
        self.works: list[Any] = []
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulated)

    def arm(self) -> None:
        self.armed, self.left, self.started, self.works = True, list(self.sizes), 0, []

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self.left[self.bucket_of[id(param)]] -= 1
        while self.started < len(self.views) and self.left[self.started] == 0:
            self._start()

    def _start(self) -> None:
        self.works.append(self.collective.start_sum(self.views[self.started]))
        self.started += 1

    def finish(self) -> None:
        self.armed = False
        self.overlapped = self.started  # buckets the backward started (the rest start now): what was hidden
        while self.started < len(self.views):
            self._start()
        for work in self.works:
            work.wait()
        self.works = []
        self.grads /= self.world_size
