"""The numeric core of the algorithms: pure tensor functions.

Definitions follow verl's ``core_algos.py`` (the de-facto reference of the field); tests check
them against independent loop implementations to 1e-6. ``B`` is the number of sequences (prompts
times samples) and ``T`` the padded response length; masks are 1 on response tokens, 0 on padding.

Two deviations from verl are deliberate and documented where they happen. Padding: whatever sits at
a masked position (zeros, garbage, even NaN or inf from a backend) never reaches a result on a
response token, and outputs are zero on padding; on right-padded inputs that are finite and carry
zero reward on padding, every function equals verl's on response tokens. Dual clip: opt-in in
:func:`ppo_policy_loss` (verl always applies it).
"""

from __future__ import annotations

from typing import Literal

import torch

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLType = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` weighted by ``mask``. ``values``, ``mask``: (B, T).

    Masked positions are selected away rather than multiplied by zero, so NaN or inf on padding
    (``0 * inf`` is NaN) cannot poison the sum, as in current verl.
    """
    weighted = _on_mask(values * mask, mask)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def _on_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is non-zero, 0 elsewhere (NaN-safe, unlike ``values * mask``)."""
    return torch.where(mask != 0, values, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1. (B, T) -> scalar, or reduced along ``dim``."""
    return masked_sum(values, mask, dim) / (masked_sum(torch.ones_like(values), mask, dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked positions, with Bessel's correction when ``unbiased``. (B, T) -> scalar."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError("masked_var needs at least two unmasked values for an unbiased estimate")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean and unit variance over masked positions. (B, T) -> (B, T)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position. (B, T, V) -> (B, T)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label. ``logits`` (B, T, V), ``labels`` (B, T) -> (B, T)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType = "k1") -> torch.Tensor:
    """Per-token KL estimate between policy and reference. (B, T), (B, T) -> (B, T).

    ``k1``/``kl``: log-ratio; ``abs``: its magnitude; ``k2``/``mse``: half its square;
    ``k3``/``low_var_kl``: Schulman's unbiased low-variance estimator, clamped to [-10, 10].
    """
    if kind in ("k1", "kl"):
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    raise ValueError(f"unknown kl_type {kind!r}; use one of k1, abs, k2 (mse), k3 (low_var_kl)")


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last response token. (B,), (B, T) -> (B, T)."""
    last = (response_mask.sum(dim=-1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    rewards[torch.arange(len(scores)), last] = scores
    return rewards * response_mask


def kl_penalized_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         response_mask: torch.Tensor, kl_coef: float, kind: KLType = "k1") -> torch.Tensor:
    """Token rewards: the score on the last token minus ``kl_coef`` times the per-token KL.

    (B,), (B, T), (B, T), (B, T) -> (B, T).
    """
    kl = _on_mask(kl_penalty(logprobs, ref_logprobs, kind), response_mask)
    return scores_to_token_rewards(scores, response_mask) - kl_coef * kl


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. (B, T) x 3 -> advantages (B, T), returns (B, T).

    Masked positions are skipped, as in current verl: their values and rewards are ignored and the
    recursion jumps to the next response token, so after the last one the bootstrap value is zero
    (the episode ends at EOS) whatever the critic wrote on padding. ``returns = advantages + values``
    is taken before the optional whitening of advantages. Deviation from verl: both outputs are zero
    on padding (verl leaves carried-over numbers there, which every consumer masks anyway).
    """
    mask = response_mask != 0
    next_values = torch.zeros_like(token_rewards[:, 0])
    last_gae = torch.zeros_like(next_values)
    reversed_adv = []
    for t in reversed(range(token_rewards.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        next_values = torch.where(mask[:, t], values[:, t], next_values)
        last_gae = torch.where(mask[:, t], delta + gamma * lam * last_gae, last_gae)
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = _on_mask(advantages + values, response_mask)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return _on_mask(advantages, response_mask), returns


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"batch of {scores.shape[0]} sequences does not split into groups of {group_size}")
    return scores.reshape(-1, group_size)


def grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, group_size: int,
                    norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative outcome advantages: each score minus its group's mean, over its std.

    Rows are grouped contiguously (the ``n`` samples of a prompt are adjacent). A group of one gets
    mean 0 and std 1, as in verl. (B,), (B, T) -> (B, T).
    """
    grouped = _groups(scores, group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(grouped), torch.ones_like(grouped)
    else:
        mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    centred = grouped - mean
    normed = centred / (std + eps) if norm_by_std else centred
    return normed.reshape(-1, 1) * response_mask


def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: a sample's total reward minus the mean of the others in its group.

    Rows are grouped contiguously; a group of one keeps its raw reward, as in verl. Rewards on
    padding are ignored (verl sums them, which is the same for the zero rewards it puts there).
    (B, T), (B, T) -> (B, T).
    """
    grouped = _groups(masked_sum(token_rewards, response_mask, dim=-1), group_size)
    if group_size > 1:
        grouped = grouped * group_size / (group_size - 1) - grouped.mean(dim=1, keepdim=True) * group_size / (
            group_size - 1
        )
    return grouped.reshape(-1, 1) * response_mask


def remax_advantages(token_rewards: torch.Tensor, baseline_scores: torch.Tensor,
                     response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy rollout's score. (B, T), (B,), (B, T) -> advantages, returns."""
    returns = _on_mask(token_rewards * response_mask, response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - baseline_scores.unsqueeze(-1) * response_mask
    return advantages, returns


def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                            gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over the batch. (B, T) x 2 -> advantages, returns.

    ``returns`` is zero on padding (verl leaves the padding rewards there; nothing reads them).
    """
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        # No return flows back across padding: the sum restarts at the last response token.
        running = _on_mask(token_rewards[:, t] + gamma * running, response_mask[:, t])
        returns[:, t] = running
    return _on_mask(masked_whiten(returns, response_mask), response_mask), returns


def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                     group_size: int) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline, then batch whitening. (B, T), (B, T) -> (B, T).

    Rows are grouped contiguously; rewards on padding are ignored (see :func:`rloo_advantages`).
    """
    grouped = _groups(masked_sum(token_rewards, response_mask, dim=-1), group_size)
    if group_size > 1:
        grouped = grouped - grouped.mean(dim=1, keepdim=True)
    scores = grouped.reshape(-1, 1) * response_mask
    return _on_mask(masked_whiten(scores, response_mask), response_mask)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: LossAgg = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar: over tokens, or per sequence then over sequences.

    As verl's ``agg_loss``, except that a fully padded row adds 0 to ``seq-mean-token-mean`` (verl: NaN).
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / (mask.sum(dim=-1) + 1e-8)).mean()
    raise ValueError(f"unknown loss_agg {mode!r}; use token-mean, seq-mean-token-sum or seq-mean-token-mean")


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                    dual_clip: float | None = None,
                    agg: LossAgg = "token-mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective, with optional dual clip (``dual_clip`` > 1) for negative advantages.

    All inputs (B, T). Returns the scalar loss and ``clipfrac``, ``clipfrac_lower``, ``approx_kl``.
    Deviation from verl: verl always dual-clips (``clip_ratio_c=3.0``); here ``dual_clip=None`` is the
    plain PPO objective of the paper, TRL and OpenRLHF. Pass ``dual_clip=3.0`` for verl's numbers.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + high)
    clipped = torch.maximum(losses1, losses2)
    stats = {
        "clipfrac": masked_mean(torch.gt(losses2, losses1).float(), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask),
        "clipfrac_lower": logprobs.new_zeros(()),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip} must be > 1.0 (verl uses 3.0)")
        losses3 = -advantages * dual_clip
        lower = torch.minimum(losses3, clipped)
        stats["clipfrac_lower"] = masked_mean(
            torch.gt(clipped, losses3).float() * (advantages < 0).float(), response_mask
        )
        clipped = torch.where(advantages < 0, lower, clipped)
    return aggregate_loss(clipped, response_mask, agg), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, clip_range: float | None = 0.2,
               agg: LossAgg = "token-mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, ``0.5 * max((v - R)^2, (clip(v) - R)^2)``. All inputs (B, T)."""
    losses1 = (values - returns).square()
    if clip_range is None:
        return 0.5 * aggregate_loss(losses1, response_mask, agg), {"vf_clipfrac": values.new_zeros(())}
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    losses2 = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(losses1, losses2), response_mask, agg)
    return loss, {"vf_clipfrac": masked_mean(torch.gt(losses2, losses1).float(), response_mask)}


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor,
            kind: KLType = "low_var_kl", agg: LossAgg = "token-mean") -> torch.Tensor:
    """KL to the reference as a loss term (GRPO style). (B, T) x 3 -> scalar."""
    return aggregate_loss(kl_penalty(logprobs, ref_logprobs, kind), response_mask, agg)


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, agg: LossAgg = "token-mean") -> torch.Tensor:
    """Mean entropy, to subtract from the loss times an entropy coefficient. (B, T) -> scalar."""
    return aggregate_loss(entropy, response_mask, agg)

