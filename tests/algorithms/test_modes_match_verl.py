"""The modes issue 11 added, against loop transcriptions of current verl (``verl-project/verl``, 2026-08).

As in ``test_core_matches_verl.py``, the references loop over Python floats and share no code with the
core. Batches here are harder: masks with holes inside responses (multi-turn observation tokens), a
fully masked row, and prompt ids whose groups are scattered and of unequal size.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
import torch
from hybridflow.algorithms import core

SEEDS = range(5)
ATOL = 1e-6
Rows = list[list[float]]


def batch(seed: int, rows: int = 8, steps: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, steps + 1, (rows,), generator=gen)
    lengths[0] = steps
    mask = (torch.arange(steps)[None, :] < lengths[:, None]).double()
    mask[1, 1:3] = 0  # a hole inside a response
    mask[1, 0] = mask[1, 3] = 1
    mask[5] = 0  # a padding row

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {"mask": mask, "rewards": randn(rows, steps) * mask, "scores": randn(rows),
            "uid": torch.randint(0, 3, (rows,), generator=gen), "logprobs": -randn(rows, steps).abs(),
            "old_logprobs": -randn(rows, steps).abs(), "ref_logprobs": -randn(rows, steps).abs(),
            "advantages": randn(rows, steps), "loss": randn(rows, steps)}


def rows_of(tensor: torch.Tensor) -> Rows:
    return tensor.tolist()


def ref_agg(loss: Rows, mask: Rows, mode: str, tokens: float | None = None, seqs: float | None = None,
            scale: float | None = None) -> float:
    """verl's agg_loss with dp_size 1; tokens / seqs / scale are its batch_num_tokens / global_batch_size /
    loss_scale_factor."""
    sums = [sum(v * m for v, m in zip(row, mr, strict=True)) for row, mr in zip(loss, mask, strict=True)]
    counts = [sum(mr) for mr in mask]
    if mode == "token-mean":
        return sum(sums) / (sum(counts) if tokens is None else tokens)
    if mode == "token-sum":
        return sum(sums)
    non_empty = [float(c > 0) for c in counts]
    if mode == "seq-mean-token-mean":
        sums = [s / (c + 1e-8) for s, c in zip(sums, counts, strict=True)]
    seq_mean = sum(s * k for s, k in zip(sums, non_empty, strict=True)) / (sum(non_empty) if seqs is None else seqs)
    if mode == "seq-mean-token-sum-norm":
        return seq_mean / (len(mask[0]) if scale is None else scale)
    return seq_mean


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", core.LOSS_AGGS)
def test_aggregation_alone_and_with_global_counts(seed, mode):
    b = batch(seed)
    loss, mask = rows_of(b["loss"]), rows_of(b["mask"])
    assert core.aggregate_loss(b["loss"], b["mask"], mode).item() == pytest.approx(ref_agg(loss, mask, mode),
                                                                                     abs=ATOL)
    norm = core.LossNorm(tokens=50.0, seqs=11.0, horizon=16.0)
    got = core.aggregate_loss(b["loss"], b["mask"], mode, norm).item()
    assert got == pytest.approx(ref_agg(loss, mask, mode, 50.0, 11.0, 16.0), abs=ATOL)


def by_index(scores: list[float], index: list[int]) -> dict[int, list[float]]:
    groups: dict[int, list[float]] = defaultdict(list)
    for score, idx in zip(scores, index, strict=True):
        groups[idx].append(score)
    return groups


def ref_grpo(scores: list[float], index: list[int], norm_by_std: bool) -> list[float]:
    groups = by_index(scores, index)
    out = []
    for score, idx in zip(scores, index, strict=True):
        group = groups[idx]
        mean, std = (0.0, 1.0) if len(group) == 1 else (statistics.mean(group), statistics.stdev(group))
        out.append((score - mean) / (std + 1e-6) if norm_by_std else score - mean)
    return out


def ref_rloo(scores: list[float], index: list[int]) -> list[float]:
    groups = by_index(scores, index)
    out = []
    for score, idx in zip(scores, index, strict=True):
        n = len(groups[idx])
        out.append(score * n / (n - 1) - statistics.mean(groups[idx]) * n / (n - 1) if n > 1 else score)
    return out


def ref_masked_whiten(values: Rows, mask: Rows) -> Rows:
    flat = [v for row, mr in zip(values, mask, strict=True) for v, m in zip(row, mr, strict=True) if m]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    return [[(v - mean) / math.sqrt(var + 1e-8) * m for v, m in zip(row, mr, strict=True)]
            for row, mr in zip(values, mask, strict=True)]


def ref_rpp_baseline(scores: list[float], index: list[int], mask: Rows) -> Rows:
    groups = by_index(scores, index)
    centred = [s - (statistics.mean(groups[i]) if len(groups[i]) > 1 else 0.0) for s, i in zip(scores, index,
                                                                                                  strict=True)]
    return ref_masked_whiten([[c * m for m in mr] for c, mr in zip(centred, mask, strict=True)], mask)


def tiled(values: list[float], mask: Rows) -> Rows:
    return [[v * m for m in mr] for v, mr in zip(values, mask, strict=True)]


def assert_rows(actual: torch.Tensor, expected: Rows) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_advantages_by_uid(seed):
    b = batch(seed)
    mask, index = rows_of(b["mask"]), b["uid"].tolist()
    totals = [sum(r * m for r, m in zip(rr, mr, strict=True)) for rr, mr in zip(rows_of(b["rewards"]), mask,
                                                                                 strict=True)]
    for norm_by_std in (True, False):
        got = core.grpo_advantages(b["scores"], b["mask"], norm_by_std=norm_by_std, uid=b["uid"])
        assert_rows(got, tiled(ref_grpo(b["scores"].tolist(), index, norm_by_std), mask))
    assert_rows(core.rloo_advantages(b["rewards"], b["mask"], uid=b["uid"]), tiled(ref_rloo(totals, index), mask))
    got = core.reinforce_pp_baseline_advantages(b["rewards"], b["mask"], uid=b["uid"])
    assert_rows(got, ref_rpp_baseline(totals, index, mask))


def ref_reinforce_pp(rewards: Rows, mask: Rows, gamma: float) -> Rows:
    """Current verl: a masked token carries the running return through unchanged."""
    returns = []
    for r, m in zip(rewards, mask, strict=True):
        running, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            new = r[t] + gamma * running
            row[t] = new * m[t]
            running = new * m[t] + running * (1 - m[t])
        returns.append(row)
    return returns


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_with_holes(seed, gamma):
    b = batch(seed)
    adv, ret = core.reinforce_pp_advantages(b["rewards"], b["mask"], gamma)
    want = ref_reinforce_pp(rows_of(b["rewards"]), rows_of(b["mask"]), gamma)
    assert_rows(ret, want)
    assert_rows(adv, ref_masked_whiten(want, rows_of(b["mask"])))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k3", "low_var_kl", "k2", "mse"])
def test_straight_through_kl(seed, kind):
    b = batch(seed)
    logp = (b["logprobs"] * 4).requires_grad_()
    ref = b["ref_logprobs"] * 4
    plain = core.kl_penalty(logp, ref, kind)  # type: ignore[arg-type]
    through = core.kl_penalty(logp, ref, f"{kind}+")  # type: ignore[arg-type]
    torch.testing.assert_close(through, plain, atol=ATOL, rtol=0)
    (grad,) = torch.autograd.grad(through.sum(), logp)
    want = [[p - r for p, r in zip(pr, rr, strict=True)] for pr, rr in zip(rows_of(logp), rows_of(ref), strict=True)]
    assert_rows(grad, want)  # d/dlogp of 0.5 (logp - ref)^2


def ref_gspo(logp: Rows, old: Rows, adv: Rows, mask: Rows, low: float, high: float) -> tuple[float, Rows]:
    """verl's compute_policy_loss_gspo (seq-mean-token-mean) and its gradient, worked out per token."""
    losses, grads = [], []
    seqs = sum(float(sum(mr) > 0) for mr in mask)
    for lr, orow, arow, mr in zip(logp, old, adv, mask, strict=True):
        length = max(sum(mr), 1.0)
        s = math.exp(min(sum((p - o) * m for p, o, m in zip(lr, orow, mr, strict=True)) / length, 10.0))
        loss_row, grad_row = [], []
        for a, m in zip(arow, mr, strict=True):
            l1, l2 = -a * s, -a * min(max(s, 1 - low), 1 + high)
            loss_row.append(max(l1, l2))
            # The unclipped branch's gradient is -A * s per token (s's straight-through); the clipped one's is 0.
            grad_row.append((-a * s if l1 >= l2 else 0.0) * m / length / seqs)
        losses.append(loss_row)
        grads.append(grad_row)
    return ref_agg(losses, mask, "seq-mean-token-mean"), grads


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high"), [(3e-4, 4e-4), (0.05, 0.1)])
def test_gspo_loss_and_gradient(seed, low, high):
    b = batch(seed)
    logp = (b["old_logprobs"] + 0.1 * b["logprobs"].sin()).requires_grad_()
    loss, _ = core.gspo_policy_loss(logp, b["old_logprobs"], b["advantages"], b["mask"], low, high)
    (grad,) = torch.autograd.grad(loss, logp)
    want_loss, want_grad = ref_gspo(rows_of(logp), rows_of(b["old_logprobs"]), rows_of(b["advantages"]),
                                    rows_of(b["mask"]), low, high)
    assert loss.item() == pytest.approx(want_loss, abs=ATOL)
    assert_rows(grad, want_grad)


def test_adaptive_kl_controller_follows_verl_over_a_run():
    gen = torch.Generator().manual_seed(0)
    kls = (torch.rand(50, generator=gen, dtype=torch.float64) * 12).tolist()
    ctl = core.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    value = 0.2
    for kl in kls:
        value *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 256 / 10_000
        ctl.update(kl, 256)
    assert ctl.value == pytest.approx(value, rel=1e-12)
