"""DAPO's pure pieces (https://arxiv.org/abs/2503.14476), as verl's DAPO recipe defines them.

DAPO is GRPO with four changes: clip-higher (:data:`DAPO_CLIP_RATIO`, :data:`DAPO_CLIP_RATIO_HIGH`),
the token-level loss (``loss_agg="token-mean"``, already the default), overlong reward shaping
(:func:`overlong_penalty`) and dynamic sampling, which drops the groups :func:`groups_with_signal`
rejects and generates more until the batch is full: the ``dapo`` graph's filter node, which the
controller runs (a bounded "generate more" loop) and the planner costs.
"""

from __future__ import annotations

import torch
from hybridflow.algorithms.advantages import group_stats

DAPO_CLIP_RATIO = 0.2
DAPO_CLIP_RATIO_HIGH = 0.28


def overlong_penalty(response_mask: torch.Tensor, max_response_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment: 0 up to ``max_response_len - buffer_len`` tokens, then falling linearly
    to ``-penalty_factor`` at ``max_response_len``. (B, T) -> (B,), to add to the scores.

    As verl's DAPO reward manager: ``min(-(length - (max_response_len - buffer_len)) / buffer_len *
    penalty_factor, 0)``. ``length`` runs to the last response token, so masked tokens inside a response
    (a tool's output) count: they fill the context as much as generated ones. Float of the default dtype.
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"buffer_len={buffer_len} must be in (0, max_response_len={max_response_len}]")
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    lengths = torch.where(response_mask != 0, positions, 0).amax(dim=-1).to(torch.get_default_dtype())
    exceed = lengths - (max_response_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def groups_with_signal(scores: torch.Tensor, group_size: int | None = None, *,
                       uid: torch.Tensor | None = None) -> torch.Tensor:
    """Which rows dynamic sampling keeps: those whose group's scores are not all equal. (B,) -> (B,) bool.

    A group whose samples all score the same gives every sample a zero group-relative advantage, so no
    gradient. Groups of one are kept, as verl keeps them. Groups as in :func:`~hybridflow.algorithms.
    advantages.group_stats`.
    """
    _, std, size = group_stats(scores.double(), group_size, uid)
    return (std > 0) | (size == 1)
