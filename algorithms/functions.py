"""The named compute functions and losses the built-in graphs refer to.

A compute function takes the node's input fields positionally (in ``node.inputs`` order) and its
options as keywords, and returns its output fields (a tensor, or a tuple in ``node.outputs`` order).
A loss takes keyword ``outputs`` (what the model computed for the micro batch: ``logprobs`` and
``entropy`` for a policy, ``values`` for a critic), ``batch`` (the update node's input fields) and
the node's options, plus keyword ``norm``: the mini batch's :class:`core.LossNorm`, with which the loss
is the micro batch's additive share of the mini batch's loss (``None``: the micro batch alone). It
returns the scalar loss and a dict of scalar metrics.

The losses aggregate over ``batch["loss_mask"]`` when the update node reads that field, else over
``response_mask`` (graphs written before the loss mask existed); the compute functions take the mask the
graph binds (the built-in graphs bind ``loss_mask``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from hybridflow.algorithms import core, judge_functions  # noqa: F401  (registers an LLM judge's functions)
from hybridflow.algorithms import preference as _preference  # noqa: F401  (registers the ``dpo`` loss)
from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.modes import RolloutCorrection
from hybridflow.algorithms.offpolicy import rollout_correction as rollout_correction_weights

from hybridflow.registry import COMPUTE_FNS, LOSSES

Tensors = Mapping[str, torch.Tensor]
LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]


@COMPUTE_FNS.register("kl_penalized_rewards")
def kl_penalized_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         response_mask: torch.Tensor, *, kl_coef: float = 0.0, kl_type: core.KLType = "k1",
                         kl_target: float | None = None, kl_horizon: float = 10000.0,
                         state: core.KLController | None = None) -> torch.Tensor:
    """The scores as token rewards minus ``kl_coef`` times the KL to the reference (PPO's KL-in-reward).

    With ``kl_target`` the coefficient adapts (verl's ``kl_ctrl.type: adaptive``): ``state`` is the run's
    :class:`~hybridflow.algorithms.kl.AdaptiveKLController` (made by :func:`_kl_state`), whose value is used
    and then updated with this batch's mean KL over the mask (the loss mask in the built-in graphs).
    (B,), (B, T), (B, T), (B, T) -> (B, T).
    """
    if state is None:
        return core.kl_penalized_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, kl_type)
    rewards = core.kl_penalized_rewards(scores, logprobs, ref_logprobs, response_mask, state.value, kl_type)
    kl = core.kl_penalty(logprobs, ref_logprobs, kl_type)
    current = float(core.masked_mean(kl, response_mask.float(), dim=-1).mean())  # verl: per sequence, then mean
    state.update(current, n_steps=len(scores))
    return rewards


def _kl_state(*, kl_coef: float = 0.0, kl_target: float | None = None, kl_horizon: float = 10000.0,
              **_: Any) -> core.KLController | None:
    """The state an adaptive ``kl_penalized_rewards`` node keeps across steps (None: a fixed coefficient)."""
    if kl_target is None:
        return None
    return core.AdaptiveKLController(init_kl_coef=kl_coef, target_kl=kl_target, horizon=kl_horizon)


kl_penalized_rewards.make_state = _kl_state  # type: ignore[attr-defined]


@COMPUTE_FNS.register("token_rewards")
def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return core.scores_to_token_rewards(scores, response_mask)


@COMPUTE_FNS.register("gae")
def gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
        gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return core.gae_advantages(token_rewards, values, response_mask, gamma, lam, whiten)


@COMPUTE_FNS.register("grpo_advantages")
def grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uid: torch.Tensor | None = None, *,
                    group_size: int | None = None, norm_by_std: bool = True,
                    scale_rewards: core.ScaleRewards = "group") -> torch.Tensor:
    return core.grpo_advantages(scores, response_mask, group_size, norm_by_std, uid=uid, scale=scale_rewards)


@COMPUTE_FNS.register("mask_truncated")
def mask_truncated(loss_mask: torch.Tensor, response_mask: torch.Tensor, *, max_new_tokens: int) -> torch.Tensor:
    """The loss mask without truncated responses (TRL's ``mask_truncated_completions``). (B, T) -> (B, T)."""
    return core.truncation_mask(loss_mask, response_mask, max_new_tokens=max_new_tokens)


@COMPUTE_FNS.register("rloo_advantages")
def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, uid: torch.Tensor | None = None, *,
                    group_size: int | None = None) -> torch.Tensor:
    return core.rloo_advantages(token_rewards, response_mask, group_size, uid=uid)


@COMPUTE_FNS.register("remax_advantages")
def remax_advantages(token_rewards: torch.Tensor, baseline_scores: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    return core.remax_advantages(token_rewards, baseline_scores, response_mask)[0]


@COMPUTE_FNS.register("reinforce_pp_advantages")
def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, *,
                            gamma: float = 1.0) -> torch.Tensor:
    return core.reinforce_pp_advantages(token_rewards, response_mask, gamma)[0]


@COMPUTE_FNS.register("reinforce_pp_baseline_advantages")
def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                     uid: torch.Tensor | None = None, *, group_size: int | None = None) -> torch.Tensor:
    return core.reinforce_pp_baseline_advantages(token_rewards, response_mask, group_size, uid=uid)


@COMPUTE_FNS.register("teacher_kl_advantages")
def teacher_kl_advantages(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                          advantages: torch.Tensor | None = None, *, teacher_kl_coef: float = 1.0,
                          advantages_coef: float = 1.0) -> torch.Tensor:
    """``teacher_kl_coef`` x the reverse-KL advantage to the teacher (:func:`core.teacher_kl_advantages`), plus
    ``advantages_coef`` x the graph's other ``advantages`` when given (a task reward's). (B, T) x 3 or 4 -> (B, T).
    """
    teacher = core.teacher_kl_advantages(teacher_logprobs, old_logprobs, loss_mask)
    total = teacher_kl_coef * teacher
    if advantages is not None:
        total = total + advantages_coef * advantages.to(teacher.dtype)
    return core.on_mask(total, loss_mask)


@COMPUTE_FNS.register("overlong_penalized_scores")
def overlong_penalized_scores(scores: torch.Tensor, response_mask: torch.Tensor, *, max_response_len: int,
                              buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's overlong reward shaping: the scores plus :func:`core.overlong_penalty`."""
    penalty = core.overlong_penalty(response_mask, max_response_len, buffer_len, penalty_factor)
    return scores + penalty.to(scores.dtype)


@COMPUTE_FNS.register("add_env_rewards")
def add_env_rewards(outcome_scores: torch.Tensor, env_rewards: torch.Tensor, *, weight: float = 1.0) -> torch.Tensor:
    """A multi-turn rollout's scores (B,): the reward node's plus ``weight`` x the environment's (B,)."""
    return outcome_scores + weight * env_rewards.to(outcome_scores.dtype)


@COMPUTE_FNS.register("groups_with_signal")
def groups_with_signal(scores: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: keep the rows of prompts whose samples' scores differ. (B,) -> (B,) bool."""
    return core.groups_with_signal(scores, uid=uid)


def loss_mask(batch: Tensors) -> torch.Tensor:
    """The mask a loss aggregates with: ``loss_mask`` (B, T) when the update reads it, else ``response_mask``."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]


def _with_scale_factor(norm: core.LossNorm | None, mask: torch.Tensor,
                       loss_scale_factor: float | None) -> core.LossNorm | None:
    """The norm with ``loss_scale_factor`` (a constant horizon, verl's name) in place of the padded length."""
    if loss_scale_factor is None:
        return norm
    return replace(norm or core.loss_norm(mask), horizon=float(loss_scale_factor))


def _add_kl_and_entropy(loss: torch.Tensor, stats: dict[str, torch.Tensor], outputs: Tensors, batch: Tensors, *,
                        kl_coef: float, kl_type: core.KLType, entropy_coef: float, loss_agg: core.LossAgg,
                        norm: core.LossNorm | None) -> LossResult:
    mask = batch["loss_mask"]
    # approx_kl is computed from the live log-probs: detach it so a logged metric cannot hold the graph.
    metrics = {"pg_loss": loss.detach(), **{name: stat.detach() for name, stat in stats.items()}}
    if kl_coef:
        kl = core.kl_loss(outputs["logprobs"], batch["ref_logprobs"], mask, kl_type, loss_agg, norm=norm)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = kl.detach()  # the term as the loss aggregates it
        # The estimator's mean per trained token whatever loss_agg, TRL's ``kl`` (the update loop weighs it by tokens).
        metrics["kl"] = masked_mean(core.kl_penalty(outputs["logprobs"].detach(), batch["ref_logprobs"], kl_type),
                                    mask)
    if "ref_logprobs" in batch:
        # k1 of the current policy to the reference per trained token: the step's ``kl`` metric when the update
        # took its old log-probs from its own forward (hybridflow/graph/skipping.py), so no batch field holds them.
        metrics["ref_kl"] = masked_mean(outputs["logprobs"].detach() - batch["ref_logprobs"], mask)
    if "entropy" in outputs:
        loss = loss - entropy_coef * core.entropy_bonus(outputs["entropy"], mask, loss_agg, norm=norm)
        metrics["entropy"] = masked_mean(outputs["entropy"].detach(), mask)  # nats per trained token
    return loss, metrics


@LOSSES.register("ppo_policy")
def ppo_policy(*, outputs: Tensors, batch: Tensors, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
               dual_clip: float | None = None, kl_coef: float = 0.0, kl_type: core.KLType = "low_var_kl",
               entropy_coef: float = 0.0, loss_agg: core.LossAgg = "token-mean",
               loss_scale_factor: float | None = None, rollout_correction: RolloutCorrection | None = None,
               rollout_is_cap: float = 2.0, norm: core.LossNorm | None = None) -> LossResult:
    """PPO clipped surrogate, plus a KL-to-reference term (GRPO) and an entropy bonus when asked.

    ``rollout_correction`` (``tis`` or ``decoupled``, :mod:`hybridflow.algorithms.offpolicy`) weights each token
    by the trainer's over the rollout engine's probability (``batch["rollout_logprobs"]``), capped at
    ``rollout_is_cap``; the metrics then add ``rollout_is_mean``/``_min``/``_max`` (the weights of the kept
    tokens), ``rollout_is_kept_fraction`` and ``rollout_logprob_gap_max`` (the largest ``|old - rollout|``; float
    noise on-policy). With ``norm`` (the mini batch's global counts) the loss is this micro batch's additive
    share; the metrics are the micro batch's own values either way.
    """
    mask, weights = loss_mask(batch), None
    if rollout_correction is not None:
        if "rollout_logprobs" not in batch:
            raise KeyError(f"ppo_policy: rollout_correction={rollout_correction!r} needs the rollout engine's "
                           "log-probs as an input field 'rollout_logprobs' of the update node (a generate node "
                           "with logprobs=True writes it)")
        weights, mask = rollout_correction_weights(batch["old_logprobs"], batch["rollout_logprobs"], mask,
                                                   mode=rollout_correction, cap=rollout_is_cap)

    def compute(norm: core.LossNorm | None) -> LossResult:
        norm = _with_scale_factor(norm, mask, loss_scale_factor)
        loss, stats = core.ppo_policy_loss(outputs["logprobs"], batch["old_logprobs"], batch["advantages"], mask,
                                           clip_ratio, clip_ratio_high, dual_clip, loss_agg, norm=norm,
                                           token_weights=weights)
        if weights is not None:
            stats.update(_correction_metrics(weights, mask, batch))
        return _add_kl_and_entropy(loss, stats, outputs, {**batch, "loss_mask": mask}, kl_coef=kl_coef,
                                   kl_type=kl_type, entropy_coef=entropy_coef, loss_agg=loss_agg, norm=norm)

    return _share_with_micro_metrics(compute, norm)


def _correction_metrics(weights: torch.Tensor, kept: torch.Tensor, batch: Tensors) -> dict[str, torch.Tensor]:
    """How far the rollout's log-probs are from the trainer's: the weights applied on the ``kept`` tokens (1 on-policy)
    and the largest log-prob gap over all trained tokens (the loss mask: ``rollout_logprobs`` are 0 elsewhere).
    All inputs (B, T); neutral values without tokens."""
    mask = loss_mask(batch)
    on, tokens = kept != 0, mask != 0
    gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs()
    one = weights.new_ones(())
    return {"rollout_is_mean": masked_mean(weights, kept) if on.any() else one,
            "rollout_is_min": weights[on].min() if on.any() else one,
            "rollout_is_max": weights[on].max() if on.any() else one,
            "rollout_is_kept_fraction": on.sum() / tokens.sum() if tokens.any() else one,
            "rollout_logprob_gap_max": gap[tokens].max() if tokens.any() else 0 * one}


@LOSSES.register("gspo_policy")
def gspo_policy(*, outputs: Tensors, batch: Tensors, clip_ratio: float = 3e-4, clip_ratio_high: float | None = 4e-4,
                kl_coef: float = 0.0, kl_type: core.KLType = "low_var_kl", entropy_coef: float = 0.0,
                loss_agg: core.LossAgg = "seq-mean-token-mean", loss_scale_factor: float | None = None,
                norm: core.LossNorm | None = None) -> LossResult:
    """GSPO: the clipped surrogate on sequence-level importance ratios; KL and entropy terms as ``ppo_policy``."""
    mask = loss_mask(batch)

    def compute(norm: core.LossNorm | None) -> LossResult:
        norm = _with_scale_factor(norm, mask, loss_scale_factor)
        loss, stats = core.gspo_policy_loss(outputs["logprobs"], batch["old_logprobs"], batch["advantages"], mask,
                                            clip_ratio, clip_ratio_high, loss_agg, norm=norm)
        return _add_kl_and_entropy(loss, stats, outputs, {**batch, "loss_mask": mask}, kl_coef=kl_coef, kl_type=kl_type,
                                   entropy_coef=entropy_coef, loss_agg=loss_agg, norm=norm)

    return _share_with_micro_metrics(compute, norm)


@LOSSES.register("value")
def value(*, outputs: Tensors, batch: Tensors, clip_range: float | None = 0.2,
          loss_agg: core.LossAgg = "token-mean", loss_scale_factor: float | None = None,
          norm: core.LossNorm | None = None) -> LossResult:
    """Clipped value regression of the critic onto the GAE returns (a share under ``norm``), over the loss mask."""
    mask = loss_mask(batch)

    def compute(norm: core.LossNorm | None) -> LossResult:
        loss, stats = core.value_loss(outputs["values"], batch["values"], batch["returns"], mask, clip_range,
                                      loss_agg, norm=_with_scale_factor(norm, mask, loss_scale_factor))
        return loss, {"vf_loss": loss.detach(), **{name: stat.detach() for name, stat in stats.items()}}

    return _share_with_micro_metrics(compute, norm)


def _share_with_micro_metrics(compute: Callable[[core.LossNorm | None], LossResult],
                              norm: core.LossNorm | None) -> LossResult:
    """The loss to differentiate (a share of the mini batch's under ``norm``) with metrics of the micro batch
    alone, so the update loop averages metrics the same way whether or not it normalises globally."""
    loss, metrics = compute(norm)
    if norm is None:
        return loss, metrics
    with torch.no_grad():
        _, metrics = compute(None)
    return loss, metrics

