"""The torch reference role engine: one replica of a role's model per rank, gradients averaged."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.torch import modeling

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import NonFiniteLossError
from hybridflow.runtime.protocols import LossFn, OptimSpec, RoleSpec, SamplingParams, WorkerContext


class TorchRoleEngine:
    """A :class:`~hybridflow.runtime.protocols.RoleEngine` over a Hugging Face module.

    Data parallel ranks each hold a full replica (DDP-like); ``layout.tp`` > 1 is for other backends.
    """

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> None:
        if layout.tp != 1:
            raise ValueError(f"RoleLayout({spec.name}).tp={layout.tp}: the torch backend has no tensor "
                             "parallelism; use tp=1 or the fsdp/vllm backend")
        self.spec, self.context = spec, context
        self.micro_batch_size = spec.micro_batch_size or layout.micro_batch_size
        self.forward_micro_batch_size = layout.forward_micro_batch_size or self.micro_batch_size
        self.model = modeling.load_model(spec.kind, spec.model, dtype=layout.dtype, seed=spec.seed)
        self.model.to(context.device)
        self.optimizer: torch.optim.Optimizer | None = None
        if spec.kind.trainable:
            optim = spec.optim or OptimSpec()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas,
                                               weight_decay=optim.weight_decay)
        else:
            self.model.requires_grad_(False)
        self.model.eval()  # tiny configs have no dropout; eval keeps HF from sampling any

    def _map_micro(self, batch: Batch, fn: Callable[[Batch], dict[str, torch.Tensor]]) -> Batch:
        with torch.no_grad():
            parts = [Batch(fn(micro)) for micro in batch.split(self.forward_micro_batch_size)]
        return Batch.concat(parts)

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        with torch.no_grad():
            out = modeling.generate(self.model, batch, max_new_tokens=sampling.max_new_tokens,
                                    greedy=sampling.greedy, temperature=sampling.temperature, top_p=sampling.top_p,
                                    top_k=sampling.top_k, seed=sampling.seed * 1009 + self.context.rank,
                                    use_hf_generate=self.spec.options.get("rollout") == "hf_generate")
        return Batch(out)

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        return self._map_micro(batch, lambda m: modeling.policy_outputs(self.model, m, with_entropy=with_entropy))

    def values(self, batch: Batch) -> Batch:
        return self._map_micro(batch, lambda m: modeling.value_outputs(self.model, m))

    def score(self, batch: Batch) -> Batch:
        return self._map_micro(batch, lambda m: {"scores": modeling.reward_model_scores(self.model, m)})

    def _outputs(self, micro: Batch) -> dict[str, torch.Tensor]:
        if self.spec.kind is RoleKind.VALUE:
            return modeling.value_outputs(self.model, micro)
        return modeling.policy_outputs(self.model, micro, with_entropy=True)

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        if self.optimizer is None:
            raise TypeError(f"role {self.spec.name!r} ({self.spec.kind}) is frozen and cannot be updated")
        optim = self.spec.optim or OptimSpec()
        totals: dict[str, float] = {}
        steps = 0
        self.model.train()
        try:
            for _ in range(optim.epochs):
                padded, _pad = batch.pad_to_multiple(optim.mini_batches)
                for mini in padded.chunk(optim.mini_batches):
                    stats = self._optimizer_step(mini, loss, options, optim.grad_clip)
                    for key, value in stats.items():
                        totals[key] = totals.get(key, 0.0) + value
                    steps += 1
        finally:
            self.model.eval()
        return {key: value / steps for key, value in totals.items()}

    def _optimizer_step(self, mini: Batch, loss: LossFn, options: Mapping[str, Any],
                        grad_clip: float) -> dict[str, float]:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=False)
        sums: dict[str, float] = {}
        finite = True
        for micro in mini.split(self.micro_batch_size):
            fields = {name: micro.tensors[name] for name in micro.tensors}
            value, stats = loss(outputs=self._outputs(micro), batch=fields, **options)
            if not torch.isfinite(value):
                finite = False
                break
            weight = len(micro) / len(mini)  # micro losses are means: weight by their share of rows
            (value * weight).backward()
            for key, stat in {"loss": value.detach(), **stats}.items():
                sums[key] = sums.get(key, 0.0) + float(torch.as_tensor(stat).detach()) * weight
        params = [p for p in self.model.parameters() if p.grad is not None]
        flag = torch.tensor([0.0 if finite else 1.0])
        # Every rank joins the same all-reduce even on a bad loss, so no rank is left waiting.
        self.context.collective.all_reduce_mean([flag, *(p.grad for p in params if p.grad is not None)])
        if flag.item() > 0:
            self.optimizer.zero_grad(set_to_none=False)
            raise NonFiniteLossError(f"role {self.spec.name!r}: non-finite loss on a rank; the step was aborted "
                                     "before the optimizer step (lower the learning rate or check the inputs)")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=False)
            raise NonFiniteLossError(f"role {self.spec.name!r}: non-finite gradient norm; step aborted")
        self.optimizer.step()
        return {**sums, "grad_norm": float(grad_norm), "lr": float(self.optimizer.param_groups[0]["lr"])}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(state))

    def save_checkpoint(self, directory: str) -> None:
        if self.context.rank != 0:  # replicas are identical: rank 0 writes for the group
            return
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        torch.save(state, path / "state.pt")

    def load_checkpoint(self, directory: str) -> None:
        state = torch.load(Path(directory) / "state.pt", map_location=self.context.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])


class TorchBackend:
    """Builds :class:`TorchRoleEngine` s; the module-level ``BACKEND`` is what the registry finds."""

    name = "torch"

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> TorchRoleEngine:
        return TorchRoleEngine(spec, layout, context)


BACKEND = TorchBackend()
