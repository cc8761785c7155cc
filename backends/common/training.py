"""The update loop every training backend shares: epochs x mini batches x micro batches.

Backends differ only in how one micro batch goes backward, how ranks agree that every loss was finite,
and how an optimizer step is taken (:class:`GradientSteps` hooks); the order of the loops, the loss
weighting and the metric averaging are written once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from hybridflow.backends.common import modeling

from hybridflow.graph import RoleKind
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import NonFiniteLossError
from hybridflow.runtime.protocols import LossFn, OptimSpec, RoleSpec


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


def non_finite(role: str, what: str = "loss on a rank") -> NonFiniteLossError:
    return NonFiniteLossError(f"role {role!r}: non-finite {what}; the step was aborted before the optimizer step "
                              "(lower the learning rate or check the inputs)")


class GradientSteps:
    """``train_step`` for an engine: the shared loop over the hooks below.

    Engines set ``spec`` and ``micro_batch_size`` and implement :meth:`training_forward` (what the loss
    reads), :meth:`zero_grad`, :meth:`backward` and :meth:`optimizer_step`, which makes every rank agree
    on ``finite`` (raising :func:`non_finite` when a rank saw a bad loss), clips and steps, returning
    ``grad_norm``/``lr`` metrics.
    """

    spec: RoleSpec
    micro_batch_size: int

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        if not self.spec.kind.trainable:
            raise TypeError(f"role {self.spec.name!r} ({self.spec.kind}) is frozen and cannot be updated")
        optim = self.spec.optim or OptimSpec()
        totals: dict[str, float] = {}
        steps = 0
        self.train_mode(True)
        try:
            for _ in range(optim.epochs):
                padded, _pad = batch.pad_to_multiple(optim.mini_batches)
                for mini in padded.chunk(optim.mini_batches):
                    self.zero_grad()
                    sums, finite = accumulate(mini, micro_batch_size=self.micro_batch_size,
                                              forward=self.training_forward, loss=loss, options=options,
                                              backward=self.backward)
                    for key, value in {**sums, **self.optimizer_step(finite, optim)}.items():
                        totals[key] = totals.get(key, 0.0) + value
                    steps += 1
        finally:
            self.train_mode(False)
        return {key: value / steps for key, value in totals.items()}

    def training_forward(self, micro: Batch) -> dict[str, torch.Tensor]:
        """What a trainable role's loss reads: values for a critic, log-probs and entropy for a policy."""
        model = self.training_module()
        if self.spec.kind is RoleKind.VALUE:
            return modeling.value_outputs(model, micro)
        return modeling.policy_outputs(model, micro, with_entropy=True)

    def training_module(self) -> Any:
        """The module whose forward builds the graph ``backward`` differentiates."""
        raise NotImplementedError

    def train_mode(self, training: bool) -> None:
        self.training_module().train(training)

    def zero_grad(self) -> None:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, finite: bool, optim: OptimSpec) -> dict[str, float]:
        raise NotImplementedError
