"""The numeric core of the algorithms: pure tensor functions, gathered in one namespace.

The maths lives in small modules: :mod:`~hybridflow.algorithms.masked` (masked statistics),
:mod:`~hybridflow.algorithms.aggregation` (loss modes and the global :class:`LossNorm`),
:mod:`~hybridflow.algorithms.kl` (KL estimators and controllers), :mod:`~hybridflow.algorithms.advantages`
(rewards, returns, advantages), :mod:`~hybridflow.algorithms.losses` (policy, value, KL and entropy
losses) and :mod:`~hybridflow.algorithms.dapo` (DAPO's pieces). ``core.X`` reaches all of them.

Definitions follow verl's ``core_algos.py`` (the de-facto reference of the field); tests check
them against independent loop implementations to 1e-6. ``B`` is the number of sequences (prompts
times samples) and ``T`` the padded response length; masks are 1 on response tokens, 0 on padding. The
mask a loss, an advantage or a KL term takes is the *loss mask* (the ``loss_mask`` field, 0 also on tokens a
multi-turn rollout kept in a response without training on them); it is ``response_mask`` otherwise.

Two deviations from verl are deliberate and documented where they happen. Padding: whatever sits at
a masked position (zeros, garbage, even NaN or inf from a backend) never reaches a result on a
response token, and outputs are zero on padding; on right-padded inputs that are finite and carry
zero reward on padding, every function equals verl's on response tokens. Dual clip: opt-in in
:func:`ppo_policy_loss` (verl always applies it).
"""

from __future__ import annotations

from hybridflow.algorithms.advantages import (
    gae_advantages,
    group_stats,
    grpo_advantages,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
    teacher_kl_advantages,
    truncation_mask,
)
from hybridflow.algorithms.aggregation import LossNorm, aggregate_loss, loss_norm, sum_loss_norms
from hybridflow.algorithms.dapo import (
    DAPO_CLIP_RATIO,
    DAPO_CLIP_RATIO_HIGH,
    groups_with_signal,
    overlong_penalty,
)
from hybridflow.algorithms.kl import AdaptiveKLController, FixedKLController, KLController, kl_penalty
from hybridflow.algorithms.losses import (
    entropy_bonus,
    gspo_policy_loss,
    kl_loss,
    ppo_policy_loss,
    value_loss,
)
from hybridflow.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten, on_mask
from hybridflow.algorithms.modes import KL_TYPES, LOSS_AGGS, SCALE_REWARDS, KLType, LossAgg, ScaleRewards

from hybridflow.logits import token_entropy as entropy_from_logits
from hybridflow.logits import token_logprobs as logprobs_from_logits

__all__ = [
    "DAPO_CLIP_RATIO",
    "DAPO_CLIP_RATIO_HIGH",
    "KL_TYPES",
    "LOSS_AGGS",
    "SCALE_REWARDS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLType",
    "LossAgg",
    "LossNorm",
    "ScaleRewards",
    "aggregate_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantages",
    "group_stats",
    "groups_with_signal",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_norm",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "on_mask",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "scores_to_token_rewards",
    "sum_loss_norms",
    "teacher_kl_advantages",
    "truncation_mask",
    "value_loss",
]
