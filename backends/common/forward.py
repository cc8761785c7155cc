"""The forward ops every backend's engine shares: ``generate``, ``log_probs``, ``values`` and ``score``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from hybridflow.backends.common import modeling

from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import RoleSpec, SamplingParams, WorkerContext


def forward_role_op(model: Any, batch: Batch, micro_batch_size: int,
                    fn: Callable[[Any, Batch], dict[str, torch.Tensor]]) -> Batch:
    """A forward-only op (log-probs, values, scores) over ``batch`` in micro batches, without gradients."""
    with torch.no_grad():
        parts = [Batch(fn(model, micro)) for micro in batch.split(micro_batch_size)]
    return Batch.concat(parts)


class ForwardOps:
    """``generate``, ``log_probs``, ``values`` and ``score`` over an engine's HF ``model``.

    Generation runs under :meth:`whole_weights`: a sharded engine gathers its parameters for the
    duration, since generation takes a data-dependent number of forward passes per rank that
    per-forward gathers would deadlock on. The other ops go micro batch by micro batch, every rank
    in step. Engines set ``spec``, ``context``, ``model`` and ``forward_batch_size``; the ``hf_generate``
    rollout sets ``use_hf_generate`` (HF ``generate`` instead of the lean cached loop).
    """

    spec: RoleSpec
    context: WorkerContext
    model: Any
    forward_batch_size: int
    use_hf_generate: bool = False

    @contextlib.contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Whole parameters on this rank for the duration (a replica holds them already)."""
        yield

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        with torch.no_grad(), self.whole_weights():
            out = modeling.generate(self.model, batch, max_new_tokens=sampling.max_new_tokens,
                                    greedy=sampling.greedy, temperature=sampling.temperature, top_p=sampling.top_p,
                                    top_k=sampling.top_k, seed=sampling.rank_seed(self.context.rank),
                                    use_hf_generate=self.use_hf_generate, logprobs=sampling.logprobs)
        return Batch(out)

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        return forward_role_op(self.model, batch, self.forward_batch_size,
                               lambda model, m: modeling.policy_outputs(model, m, with_entropy=with_entropy))

    def values(self, batch: Batch) -> Batch:
        return forward_role_op(self.model, batch, self.forward_batch_size, modeling.value_outputs)

    def score(self, batch: Batch) -> Batch:
        return forward_role_op(self.model, batch, self.forward_batch_size,
                               lambda model, m: {"scores": modeling.reward_model_scores(model, m)})
