"""The named compute functions and losses the built-in graphs refer to.

A compute function takes the node's input fields positionally (in ``node.inputs`` order) and its
options as keywords, and returns its output fields (a tensor, or a tuple in ``node.outputs`` order).
A loss takes keyword ``outputs`` (what the model computed for the micro batch: ``logprobs`` and
``entropy`` for a policy, ``values`` for a critic), ``batch`` (the update node's input fields) and
the node's options; it returns the scalar loss and a dict of scalar metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from hybridflow.algorithms import core

from hybridflow.registry import COMPUTE_FNS, LOSSES

Tensors = Mapping[str, torch.Tensor]
LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]


@COMPUTE_FNS.register("kl_penalized_rewards")
def kl_penalized_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         response_mask: torch.Tensor, *, kl_coef: float = 0.0,
                         kl_type: core.KLType = "k1") -> torch.Tensor:
    return core.kl_penalized_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, kl_type)


@COMPUTE_FNS.register("token_rewards")
def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return core.scores_to_token_rewards(scores, response_mask)


@COMPUTE_FNS.register("gae")
def gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
        gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return core.gae_advantages(token_rewards, values, response_mask, gamma, lam, whiten)


@COMPUTE_FNS.register("grpo_advantages")
def grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, *, group_size: int,
                    norm_by_std: bool = True) -> torch.Tensor:
    return core.grpo_advantages(scores, response_mask, group_size, norm_by_std)


@COMPUTE_FNS.register("rloo_advantages")
def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, *, group_size: int) -> torch.Tensor:
    return core.rloo_advantages(token_rewards, response_mask, group_size)


@COMPUTE_FNS.register("remax_advantages")
def remax_advantages(token_rewards: torch.Tensor, baseline_scores: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    return core.remax_advantages(token_rewards, baseline_scores, response_mask)[0]


@COMPUTE_FNS.register("reinforce_pp_advantages")
def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, *,
                            gamma: float = 1.0) -> torch.Tensor:
    return core.reinforce_pp_advantages(token_rewards, response_mask, gamma)[0]


@COMPUTE_FNS.register("reinforce_pp_baseline_advantages")
def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, *,
                                     group_size: int) -> torch.Tensor:
    return core.reinforce_pp_baseline_advantages(token_rewards, response_mask, group_size)


@LOSSES.register("ppo_policy")
def ppo_policy(*, outputs: Tensors, batch: Tensors, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
               dual_clip: float | None = None, kl_coef: float = 0.0, kl_type: core.KLType = "low_var_kl",
               entropy_coef: float = 0.0, loss_agg: core.LossAgg = "token-mean") -> LossResult:
    """PPO clipped surrogate, plus a KL-to-reference term (GRPO) and an entropy bonus when asked."""
    mask = batch["response_mask"]
    loss, stats = core.ppo_policy_loss(outputs["logprobs"], batch["old_logprobs"], batch["advantages"], mask,
                                       clip_ratio, clip_ratio_high, dual_clip, loss_agg)
    # approx_kl is computed from the live log-probs: detach it so a logged metric cannot hold the graph.
    metrics = {"pg_loss": loss.detach(), **{name: stat.detach() for name, stat in stats.items()}}
    if kl_coef:
        kl = core.kl_loss(outputs["logprobs"], batch["ref_logprobs"], mask, kl_type, loss_agg)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = kl.detach()
    if "entropy" in outputs:
        entropy = core.entropy_bonus(outputs["entropy"], mask, loss_agg)
        loss = loss - entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    return loss, metrics


@LOSSES.register("value")
def value(*, outputs: Tensors, batch: Tensors, clip_range: float | None = 0.2,
          loss_agg: core.LossAgg = "token-mean") -> LossResult:
    """Clipped value regression of the critic onto the GAE returns."""
    loss, stats = core.value_loss(outputs["values"], batch["values"], batch["returns"], batch["response_mask"],
                                  clip_range, loss_agg)
    return loss, {"vf_loss": loss.detach(), **{name: stat.detach() for name, stat in stats.items()}}
