"""Token rewards, returns and advantages: what the driver computes between rollout and update.

Definitions follow verl's ``core_algos.py``. ``B`` is the number of sequences and ``T`` the padded
response length. Outputs are zero on masked positions, whatever the inputs hold there.

The mask of every function here is the *loss mask*: the built-in graphs pass the ``loss_mask`` field, which
equals ``response_mask`` unless a (multi-turn) rollout keeps tokens in a response that carry no loss (tool
outputs, observations). Such a token may sit in the middle of a response: it gets no reward, advantage or
return, and the recursions over time steps (GAE, REINFORCE++, ReMax) skip it, so credit still flows from
the agent's later tokens to its earlier ones across it (verl's multi-turn masking).

Group baselines (GRPO, RLOO, REINFORCE++-baseline) group rows either contiguously, ``group_size`` rows
per prompt (the ``n`` samples of a prompt are adjacent), or by a prompt id ``uid`` (B,): rows sharing a
uid form a group, wherever they sit and however many there are (after filtering, or partial groups),
as verl groups by its ``index``. Give exactly one of the two.
"""

from __future__ import annotations

import torch
from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.masked import masked_sum, masked_whiten, on_mask
from hybridflow.algorithms.modes import SCALE_REWARDS, KLType, ScaleRewards, check_choice


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last token inside the mask. (B,), (B, T) -> (B, T).

    With the loss mask, that is the last token the policy sampled, not a tool output after it, whose reward
    the masked recursions would drop. On a right-padded mask without holes: the last response token (verl).
    """
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask != 0, positions, 0).amax(dim=-1)
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    rewards[torch.arange(len(scores)), last] = scores
    return rewards * response_mask


def kl_penalized_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         response_mask: torch.Tensor, kl_coef: float, kind: KLType = "k1") -> torch.Tensor:
    """Token rewards: the score on the last token minus ``kl_coef`` times the per-token KL.

    (B,), (B, T), (B, T), (B, T) -> (B, T).
    """
    kl = on_mask(kl_penalty(logprobs, ref_logprobs, kind), response_mask)
    return scores_to_token_rewards(scores, response_mask) - kl_coef * kl


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. (B, T) x 3 -> advantages (B, T), returns (B, T).

    Masked positions are skipped, as in current verl: their values and rewards are ignored and the
    recursion jumps to the next unmasked token, so after the last one the bootstrap value is zero
    (the episode ends at EOS) whatever the critic wrote on padding. A masked token inside a response (a
    tool's output under the loss mask) is not a time step of the agent: the TD error of the token before it
    bootstraps from the value of the next token the agent sampled, undiscounted across the gap, and the
    masked token itself gets advantage and return 0 (no value target). ``returns = advantages + values``
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
    returns = on_mask(advantages + values, response_mask)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return on_mask(advantages, response_mask), returns


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"batch of {scores.shape[0]} sequences does not split into groups of {group_size}")
    return scores.reshape(-1, group_size)


def group_stats(values: torch.Tensor, group_size: int | None = None,
                uid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's group mean, sample std and group size. (B,) -> three (B,).

    A group of one gets mean 0 and std 1, as in verl (its row keeps its own score as the signal).
    """
    if (group_size is None) == (uid is None):
        raise ValueError("group rows either by group_size or by uid: give exactly one")
    if uid is not None:
        return _uid_stats(values, uid)
    assert group_size is not None
    grouped = _groups(values, group_size)
    size = torch.full_like(grouped, float(group_size))
    if group_size == 1:
        mean, std = torch.zeros_like(grouped), torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True).expand_as(grouped)
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped)
    return mean.reshape(-1), std.reshape(-1), size.reshape(-1)


def _uid_stats(values: torch.Tensor, uid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if uid.shape != values.shape:
        raise ValueError(f"uid has shape {tuple(uid.shape)}; it needs one id per sequence, {tuple(values.shape)}")
    index = torch.unique(uid, return_inverse=True)[1].to(values.device)
    groups = int(index.max()) + 1 if len(index) else 0
    size = values.new_zeros(groups).index_add_(0, index, torch.ones_like(values))
    mean = values.new_zeros(groups).index_add_(0, index, values) / size
    squares = values.new_zeros(groups).index_add_(0, index, (values - mean[index]).square())
    std = (squares / (size - 1).clamp(min=1)).sqrt()
    alone = size == 1
    mean = torch.where(alone, torch.zeros_like(mean), mean)
    std = torch.where(alone, torch.ones_like(std), std)
    return mean[index], std[index], size[index]


def grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, group_size: int | None = None,
                    norm_by_std: bool = True, eps: float = 1e-6, *, uid: torch.Tensor | None = None,
                    scale: ScaleRewards = "group") -> torch.Tensor:
    """Group-relative outcome advantages: each score minus its group's mean, over a std.

    ``scale`` (TRL's ``scale_rewards``): ``group``, the std of the prompt's group; ``batch``, the (sample) std of
    every score in the batch; ``none``, no division (Dr.GRPO's advantage, no difficulty bias), which
    ``norm_by_std=False`` also selects. Groups: see the module docstring. (B,), (B, T) -> (B, T).
    """
    check_choice("scale_rewards", scale, SCALE_REWARDS)
    mean, std, _ = group_stats(scores, group_size, uid)
    centred = scores - mean
    if not norm_by_std or scale == "none":
        normed = centred
    elif scale == "batch":
        normed = centred / ((scores.std() if len(scores) > 1 else scores.new_zeros(())) + eps)
    else:
        normed = centred / (std + eps)
    return normed.reshape(-1, 1) * response_mask


def truncation_mask(loss_mask: torch.Tensor, response_mask: torch.Tensor, *, max_new_tokens: int) -> torch.Tensor:
    """``loss_mask`` with every truncated response's row zeroed (TRL's ``mask_truncated_completions``): a response
    that used its whole ``max_new_tokens`` budget without the rollout stopping it earlier. (B, T), (B, T) -> (B, T).

    Deviation from TRL, which checks the last token for EOS: a response whose EOS is exactly its last allowed token
    counts as truncated here too (the graph sees lengths, not token ids).
    """
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    lengths = torch.where(response_mask != 0, positions, 0).amax(dim=-1)
    return loss_mask * (lengths < max_new_tokens).to(loss_mask.dtype).unsqueeze(-1)


def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int | None = None, *,
                    uid: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out: a sample's total reward minus the mean of the others in its group.

    A group of one keeps its raw reward, as in verl. Rewards on padding are ignored (verl sums them,
    which is the same for the zero rewards it puts there). (B, T), (B, T) -> (B, T).
    """
    totals = masked_sum(token_rewards, response_mask, dim=-1)
    mean, _, size = group_stats(totals, group_size, uid)
    others = (size - 1).clamp(min=1)
    loo = torch.where(size > 1, totals * size / others - mean * size / others, totals)
    return loo.reshape(-1, 1) * response_mask


def remax_advantages(token_rewards: torch.Tensor, baseline_scores: torch.Tensor,
                     response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy rollout's score. (B, T), (B,), (B, T) -> advantages, returns.

    Rewards on masked positions are ignored; the reward-to-go carries across a masked token inside a response,
    which itself gets 0 (as padding does).
    """
    to_go = on_mask(token_rewards, response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    returns = on_mask(to_go, response_mask)
    advantages = on_mask(returns - baseline_scores.unsqueeze(-1), response_mask)
    return advantages, returns


def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                            gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over the batch. (B, T) x 2 -> advantages, returns.

    A masked token inside a response (a tool's output in a multi-turn rollout) is skipped, as in current
    verl: its reward is ignored and the return carries across it undiscounted, so the agent's earlier
    tokens still get credit for later rewards. No return flows back from padding after the last response
    token. ``returns`` is zero on masked positions.
    """
    mask = response_mask != 0
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = on_mask(running, response_mask[:, t])
    return on_mask(masked_whiten(returns, response_mask), response_mask), returns


def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                     group_size: int | None = None, *,
                                     uid: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline, then batch whitening. (B, T), (B, T) -> (B, T).

    A group of one has no baseline, as in verl. Rewards on padding are ignored (see :func:`rloo_advantages`).
    """
    totals = masked_sum(token_rewards, response_mask, dim=-1)
    mean, _, _ = group_stats(totals, group_size, uid)
    scores = (totals - mean).reshape(-1, 1) * response_mask
    return on_mask(masked_whiten(scores, response_mask), response_mask)


def teacher_kl_advantages(teacher_logprobs: torch.Tensor, logprobs: torch.Tensor,
                          response_mask: torch.Tensor) -> torch.Tensor:
    """On-policy distillation's per-token advantage: minus each sampled token's reverse-KL estimate to a teacher,
    ``-(log π(y_t) - log π_T(y_t)) = log π_T(y_t) - log π(y_t)``, on the mask, 0 elsewhere. (B, T) x 3 -> (B, T).

    With ``logprobs`` the sampling student's own, the mean over sampled tokens estimates ``-KL(π || π_T)`` per
    token, and a policy gradient on it lowers that reverse KL (GKD, https://arxiv.org/abs/2306.13649; slime's
    ``--opd-kl-coef``). Each token's advantage is its own term: nothing is summed over later tokens or whitened.
    """
    return on_mask(teacher_logprobs - logprobs, response_mask)
