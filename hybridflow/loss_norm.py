"""What an update's loss is normalised by: the counts of the whole mini batch, over every micro batch
and data-parallel rank (verl's ``global_batch_info``).

The shared update loop (``backends/common/training.py``) builds one per mini batch and passes it to the
loss as ``norm``; the loss then returns its micro batch's additive share, so the gradient of an update
does not depend on how the mini batch was cut into micro batches or ranks. The algorithms' aggregation
modes (``hybridflow.algorithms.aggregation``) define the shares.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

TOKEN_MEAN_METRICS = frozenset({"entropy", "kl", "ref_kl"})
"""Loss metrics that are per-token means over the loss mask (nats per token): the update loop averages them over
micro batches and ranks weighted by trained tokens, so they are the update's exact token means."""


@dataclass(frozen=True, kw_only=True)
class LossNorm:
    """What the whole mini batch's loss is normalised by, counted over all its micro batches and DP ranks.

    ``tokens``: trained tokens (the sum of the loss mask: ``loss_mask``, or ``response_mask`` without one) in the
    mini batch. ``seqs``: sequences with at least one trained token (rows of padding, e.g. from evening out a
    batch, do not count, as in verl).
    ``horizon``: the constant ``seq-mean-token-sum-norm`` divides each sequence's token sum by (Dr.GRPO's
    maximum response length; verl's ``loss_scale_factor``, which defaults to the padded response length).
    Build one with :func:`loss_norm` per rank and add the counts over ranks (:func:`sum_loss_norms`).
    """

    tokens: float
    seqs: float
    horizon: float

    def __post_init__(self) -> None:
        for name in ("tokens", "seqs"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LossNorm.{name}={getattr(self, name)} must be >= 0")
        if not self.horizon > 0:
            raise ValueError(f"LossNorm.horizon={self.horizon} must be > 0")


def loss_norm(mask: torch.Tensor, horizon: float | None = None) -> LossNorm:
    """The counts of one (mini batch) loss mask (B, T); ``horizon`` defaults to T, as in verl."""
    return LossNorm(tokens=float(mask.sum()), seqs=float((mask.sum(dim=-1) > 0).sum()),
                    horizon=float(mask.shape[-1] if horizon is None else horizon))


def sum_loss_norms(norms: Iterable[LossNorm]) -> LossNorm:
    """The norm of the union of disjoint batches: counts add up, the horizon is the largest one."""
    parts = list(norms)
    if not parts:
        raise ValueError("sum_loss_norms needs at least one LossNorm")
    return LossNorm(tokens=sum(n.tokens for n in parts), seqs=sum(n.seqs for n in parts),
                    horizon=max(n.horizon for n in parts))


def accepts_norm(loss: Callable[..., Any]) -> bool:
    """Whether ``loss`` takes the ``norm`` keyword (a user's older loss may not: it then gets none)."""
    try:
        parameters = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: assume the documented contract
        return True
    return any(p.name == "norm" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
