"""Corrections for samples the trainer's policy did not generate itself (asynchronous or mismatched rollouts).

Both compare the trainer's log-probs before the update (``old_logprobs``: the *proximal* policy) with the
rollout engine's own log-probs of the sampled tokens (``rollout_logprobs``: the *behaviour* policy, which
may be a stale copy, or the same weights under another engine's kernels):

- ``tis`` (truncated importance sampling, Yao et al. 2025, verl's ``rollout_is``): each token's policy
  loss is weighted by ``min(pi_old / pi_rollout, cap)``.
- ``decoupled`` (the decoupled PPO objective of AReaL, Fu et al. 2025): the PPO ratio and clip use the
  proximal policy, and each token is weighted by ``pi_old / pi_rollout``; tokens whose weight exceeds the
  cap leave the loss (AReaL's ``behav_imp_weight_cap``).

The weights are constants (no gradient flows through them), as in both references.
"""

from __future__ import annotations

import torch
from hybridflow.algorithms.modes import ROLLOUT_CORRECTIONS as CORRECTIONS
from hybridflow.algorithms.modes import RolloutCorrection

__all__ = ["CORRECTIONS", "RolloutCorrection", "rollout_correction"]


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *,
                       mode: RolloutCorrection, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights and the mask to aggregate with. All (B, T); the mask is the loss mask
    (``rollout_logprobs`` hold no behaviour log-prob outside it).

    ``tis``: ``min(exp(old - rollout), cap)`` on the same mask. ``decoupled``: ``exp(old - rollout)`` where it is at
    most ``cap``, and those tokens only in the mask.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout_correction={mode!r} must be one of {list(CORRECTIONS)}")
    if not cap > 0:
        raise ValueError(f"rollout_is_cap={cap} must be > 0")
    weights = torch.exp(torch.clamp(old_logprobs - rollout_logprobs, min=-20.0, max=20.0)).detach()
    if mode == "tis":
        return weights.clamp(max=cap), response_mask
    keep = weights <= cap
    return torch.where(keep, weights, torch.zeros_like(weights)), response_mask * keep.to(response_mask.dtype)
