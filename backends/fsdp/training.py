"""The update loop every training backend shares: epochs x mini batches x micro batches.

Backends differ in how one micro batch goes backward and how an optimizer step is taken; the
order of the loops, the loss weighting and the metric averaging are the same as the torch
reference backend's, so the backends agree on the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from hybridflow.backends.torch import modeling

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import LossFn, OptimSpec, RoleSpec, SamplingParams, WorkerContext

MiniStep = Callable[[Batch], dict[str, float]]
"""Takes one optimizer step on a mini batch; returns its scalar metrics."""


def run_update(batch: Batch, optim: OptimSpec, mini_step: MiniStep) -> dict[str, float]:
    """Mean metrics of ``optim.epochs`` passes over ``batch`` split into ``optim.mini_batches`` steps."""
    totals: dict[str, float] = {}
    steps = 0
    for _ in range(optim.epochs):
        padded, _pad = batch.pad_to_multiple(optim.mini_batches)
        for mini in padded.chunk(optim.mini_batches):
            for key, value in mini_step(mini).items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
    return {key: value / steps for key, value in totals.items()}


def accumulate(mini: Batch, *, micro_batch_size: int, forward: Callable[[Batch], dict[str, torch.Tensor]],
               loss: LossFn, options: Mapping[str, Any],
               backward: Callable[[torch.Tensor], None]) -> tuple[dict[str, float], bool]:
    """Forward and backward every micro batch of ``mini``; returns (row-weighted metrics, all losses finite).

    Stops at the first non-finite loss without calling ``backward`` on it. ``backward`` receives the
    micro loss already weighted by the micro batch's share of rows (micro losses are means).
    """
    sums: dict[str, float] = {}
    for micro in mini.split(micro_batch_size):
        fields = {name: micro.tensors[name] for name in micro.tensors}
        value, stats = loss(outputs=forward(micro), batch=fields, **options)
        if not torch.isfinite(value):
            return sums, False
        weight = len(micro) / len(mini)
        backward(value * weight)
        for key, stat in {"loss": value, **stats}.items():
            sums[key] = sums.get(key, 0.0) + float(torch.as_tensor(stat).detach()) * weight
    return sums, True


def training_outputs(kind: RoleKind, model: Any, micro: Batch) -> dict[str, torch.Tensor]:
    """What a trainable role's loss reads: values for a critic, log-probs and entropy for a policy."""
    from hybridflow.backends.torch import modeling

    if kind is RoleKind.VALUE:
        return modeling.value_outputs(model, micro)
    return modeling.policy_outputs(model, micro, with_entropy=True)


def forward_role_op(model: Any, batch: Batch, micro_batch_size: int,
                    fn: Callable[[Any, Batch], dict[str, torch.Tensor]]) -> Batch:
    """A forward-only op (log-probs, values, scores) over ``batch`` in micro batches, without gradients."""
    with torch.no_grad():
        parts = [Batch(fn(model, micro)) for micro in batch.split(micro_batch_size)]
    return Batch.concat(parts)


class ShardedForwardOps:
    """``generate``, ``log_probs``, ``values`` and ``score`` of an engine whose weights are sharded.

    Generation runs under :meth:`whole_weights`, since it takes a data-dependent number of forward
    passes per rank that per-forward gathers would deadlock on; the other ops go micro batch by
    micro batch, every rank in step. Engines provide ``model``, ``forward_batch_size``,
    ``context`` and ``whole_weights``.
    """

    model: Any
    forward_batch_size: int
    context: Any

    def whole_weights(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        with torch.no_grad(), self.whole_weights():
            out = modeling.generate(self.model, batch, max_new_tokens=sampling.max_new_tokens,
                                    greedy=sampling.greedy, temperature=sampling.temperature, top_p=sampling.top_p,
                                    top_k=sampling.top_k, seed=sampling.seed * 1009 + self.context.rank)
        return Batch(out)

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        return forward_role_op(self.model, batch, self.forward_batch_size,
                               lambda model, m: modeling.policy_outputs(model, m, with_entropy=with_entropy))

    def values(self, batch: Batch) -> Batch:
        return forward_role_op(self.model, batch, self.forward_batch_size, modeling.value_outputs)

    def score(self, batch: Batch) -> Batch:
        return forward_role_op(self.model, batch, self.forward_batch_size,
                               lambda model, m: {"scores": modeling.reward_model_scores(model, m)})


def with_configured_rollout(engine: Any, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> Any:
    """``engine`` itself, or wrapped in a vLLM hybrid engine when ``spec.options.rollout`` asks for one."""
    if spec.options.get("rollout", "self") == "self":
        return engine
    from hybridflow.backends.vllm.hybrid import with_rollout  # vLLM loads only when a role asks for it

    return with_rollout(engine, spec, layout, context)
