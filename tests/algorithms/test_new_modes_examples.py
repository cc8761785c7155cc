"""The modes issue 11 added, on examples small enough to work by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from hybridflow.algorithms import core

from hybridflow.registry import COMPUTE_FNS

EPS = 1e-6


def t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


LOSS = t([[1, 2, 99], [3, 99, 99], [99, 99, 99]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is padding, e.g. from evening out a batch


@pytest.mark.parametrize(("mode", "alone", "shared"), [
    ("token-mean", 6 / 3, 6 / 10),
    ("token-sum", 6, 6),
    # Sequence sums 3 and 3; the empty row is not a sequence (it used to count: 6 / 3).
    ("seq-mean-token-sum", 6 / 2, 6 / 4),
    # Divided further by the horizon: the padded length 3 alone, the norm's 6 when shared.
    ("seq-mean-token-sum-norm", 6 / 2 / 3, 6 / 4 / 6),
    # Sequence means 1.5 and 3.
    ("seq-mean-token-mean", 4.5 / 2, 4.5 / 4),
])
def test_every_aggregation_by_hand(mode, alone, shared):
    assert core.aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(alone)
    norm = core.LossNorm(tokens=10, seqs=4, horizon=6)  # this micro batch is part of a bigger mini batch
    assert core.aggregate_loss(LOSS, MASK, mode, norm).item() == pytest.approx(shared)


def grad_of(kind: str, logp: float, ref: float) -> tuple[float, float]:
    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    value = core.kl_penalty(x, torch.tensor(ref, dtype=torch.float64), kind)  # type: ignore[arg-type]
    value.backward()
    assert x.grad is not None
    return value.item(), x.grad.item()


def test_straight_through_kl_has_one_estimators_value_and_k2s_gradient():
    logp, ref = math.log(0.5), math.log(0.25)
    log2 = math.log(2)
    # k3 = r - log r - 1 with r = ref / p = 1/2; d k3 / d logp = 1 - r = 1/2. k2's gradient: logp - ref = log 2.
    assert grad_of("k3", logp, ref) == pytest.approx((0.5 + log2 - 1, 0.5))
    assert grad_of("k3+", logp, ref) == pytest.approx((0.5 + log2 - 1, log2))
    assert grad_of("low_var_kl+", logp, ref) == pytest.approx((0.5 + log2 - 1, log2))
    assert grad_of("k1", logp, ref) == pytest.approx((log2, 1.0))
    assert grad_of("k1+", logp, ref) == pytest.approx((log2, log2))
    assert grad_of("abs+", ref, logp) == pytest.approx((log2, -log2))
    assert grad_of("k2+", logp, ref) == pytest.approx(grad_of("k2", logp, ref))
    with pytest.raises(ValueError, match=r"unknown kl_type 'k4\+'"):
        grad_of("k4+", logp, ref)


# Prompt 10 has three samples in rows 0, 2, 3 (not adjacent); prompts 20 and 30 one each (partial groups).
SCORES = t([1.0, 5.0, 0.0, 2.0, 7.0])
UID = torch.tensor([10, 20, 10, 10, 30])
ONES = torch.ones(5, 2, dtype=torch.float64)


def test_grpo_groups_by_uid_with_unequal_groups():
    # Prompt 10: mean 1, sample std sqrt((0 + 1 + 1) / 2) = 1. Alone: mean 0, std 1 (verl).
    adv = core.grpo_advantages(SCORES, ONES, uid=UID)
    assert adv[:, 0].tolist() == pytest.approx([0, 5 / (1 + EPS), -1 / (1 + EPS), 1 / (1 + EPS), 7 / (1 + EPS)])
    plain = core.grpo_advantages(SCORES, ONES, norm_by_std=False, uid=UID)
    assert plain[:, 1].tolist() == pytest.approx([0, 5, -1, 1, 7])
    registered = COMPUTE_FNS.get("grpo_advantages")(SCORES, ONES, UID)  # uid is the node's third input
    torch.testing.assert_close(registered, adv)


def test_rloo_and_reinforce_pp_baseline_group_by_uid():
    rewards = t([[1, 0], [5, 0], [0, 0], [0, 2], [7, 0]])  # totals 1, 5, 0, 2, 7
    rloo = core.rloo_advantages(rewards, ONES, uid=UID)
    # Each of prompt 10 minus the mean of its two others: 1 - 1, 0 - 1.5, 2 - 0.5; alone: the raw reward.
    assert rloo[:, 0].tolist() == pytest.approx([0, 5, -1.5, 1.5, 7])
    baseline = core.reinforce_pp_baseline_advantages(rewards, ONES, uid=UID)
    centred = t([0, 5, -1, 1, 7])  # no baseline alone
    tokens = centred.repeat_interleave(2)
    assert baseline[:, 0].tolist() == pytest.approx(((centred - tokens.mean()) / tokens.std()).tolist(), abs=1e-6)


@pytest.mark.parametrize("fn", [core.grpo_advantages, core.rloo_advantages, core.reinforce_pp_baseline_advantages])
def test_a_uid_per_contiguous_group_gives_the_group_size_result(fn):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(12, generator=gen, dtype=torch.float64)
    inputs = scores if fn is core.grpo_advantages else scores[:, None] * t([[1.0, 0.0, 0.0]])
    mask = (torch.arange(3)[None, :] < torch.randint(1, 4, (12,), generator=gen)[:, None]).double()
    by_size = fn(inputs, mask, 3)
    shuffled = torch.randperm(12, generator=gen)
    by_uid = fn(inputs[shuffled], mask[shuffled], uid=(torch.arange(12) // 3)[shuffled] * 7)
    torch.testing.assert_close(by_uid, by_size[shuffled])


def test_grouping_needs_exactly_one_of_group_size_and_uid():
    with pytest.raises(ValueError, match="exactly one"):
        core.grpo_advantages(SCORES, ONES)
    with pytest.raises(ValueError, match="exactly one"):
        core.rloo_advantages(ONES, ONES, 5, uid=UID)
    with pytest.raises(ValueError, match=r"uid has shape \(4,\)"):
        core.grpo_advantages(SCORES, ONES, uid=UID[:4])


def test_reinforce_pp_returns_carry_across_a_hole_inside_a_response():
    # Token 1 is a tool's output: its reward 5 is not the agent's and it is not a step of the agent.
    # gamma 0.5: t3: 2; t2: 0 + 0.5 * 2 = 1; t1 skipped; t0: 1 + 0.5 * 1 = 1.5.
    _, returns = core.reinforce_pp_advantages(t([[1, 5, 0, 2]]), t([[1, 0, 1, 1]]), gamma=0.5)
    assert returns.tolist() == [[1.5, 0, 1, 2]]


def test_adaptive_kl_controller_by_hand():
    ctl = core.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    # KL 9 is 50 % over target; the error is clipped to +20 %: 0.1 * (1 + 0.2 * 100 / 10000).
    assert ctl.update(current_kl=9.0, n_steps=100) == pytest.approx(0.1002)
    ctl.update(current_kl=3.0, n_steps=1000)  # 50 % under, clipped to -20 %: times 1 - 0.02
    assert ctl.value == pytest.approx(0.1002 * 0.98)
    ctl.update(current_kl=6.0, n_steps=1000)  # on target: unchanged
    assert ctl.value == pytest.approx(0.1002 * 0.98)
    fixed = core.FixedKLController(kl_coef=0.05)
    assert fixed.update(current_kl=100.0, n_steps=10) == 0.05 == fixed.value
    with pytest.raises(ValueError, match=r"AdaptiveKLController\.horizon=0"):
        core.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)


def test_gspo_clips_the_sequence_ratio_not_the_token_ratios():
    old, adv, mask = t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[1, 1]])
    logp = torch.log(t([[2.0, 0.5]])).requires_grad_()
    loss, stats = core.gspo_policy_loss(logp, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.2)
    # Token ratios 2 and 1/2, geometric mean 1: nothing clipped, each token's gradient -A * s / 2.
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and stats["clipfrac"].item() == 0
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx([-0.5, -0.5])
    ppo_logp = logp.detach().clone().requires_grad_()
    core.ppo_policy_loss(ppo_logp, old, adv, mask, clip_ratio=0.2)[0].backward()
    assert ppo_logp.grad is not None and ppo_logp.grad[0].tolist() == pytest.approx([0.0, -0.25])  # token 1 clipped
    far = torch.log(t([[1.5, 1.5]])).requires_grad_()
    loss, stats = core.gspo_policy_loss(far, old, adv, mask)  # s = 1.5, past the paper's 1 + 4e-4
    loss.backward()
    assert loss.item() == pytest.approx(-1.0004) and stats["clipfrac"].item() == pytest.approx(1)
    assert far.grad is not None and far.grad.abs().sum().item() == 0


def test_overlong_penalty_by_hand():
    lengths = t([5, 6, 8, 10])
    mask = (torch.arange(10)[None, :] < lengths[:, None]).double()
    # Budget 10, buffer 4: free up to 6 tokens, then -1/4 per token.
    assert core.overlong_penalty(mask, 10, 4).tolist() == pytest.approx([0, 0, -0.5, -1])
    assert core.overlong_penalty(mask, 10, 4, penalty_factor=0.5).tolist() == pytest.approx([0, 0, -0.25, -0.5])
    holed = mask.clone()
    holed[3, 2:9] = 0  # a tool's output inside the response still fills the context
    assert core.overlong_penalty(holed, 10, 4)[3].item() == pytest.approx(-1)
    shaped = COMPUTE_FNS.get("overlong_penalized_scores")(t([1, 1, 1, 1]), mask, max_response_len=10, buffer_len=4)
    assert shaped.tolist() == pytest.approx([1, 1, 0.5, 0])
    with pytest.raises(ValueError, match="buffer_len=0"):
        core.overlong_penalty(mask, 10, 0)


def test_groups_with_signal_keeps_groups_whose_scores_differ():
    scores = t([1, 1, 0, 1, 2, 2, 3])
    keep = core.groups_with_signal(scores, uid=torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, False, True, True, False, False, True]  # a lone sample is kept, as in verl
    assert core.groups_with_signal(scores[:6], 2).tolist() == keep[:6].tolist()
