"""The numeric core against straightforward transcriptions of verl's ``core_algos.py`` formulas.

The references below loop over plain Python floats, row by row and token by token, as the formulas
read; they share no code with :mod:`hybridflow.algorithms.core`. Inputs are random, float64, with
right-padded masks of random lengths; results must agree to 1e-6 on every response token.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hybridflow.algorithms import core

SEEDS = range(5)
ATOL = 1e-6
Rows = list[list[float]]


def batch(seed: int, rows: int = 6, steps: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, steps + 1, (rows,), generator=gen)
    lengths[0] = steps  # one row without padding
    mask = (torch.arange(steps)[None, :] < lengths[:, None]).double()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    rewards = randn(rows, steps) * mask  # verl's token rewards are zero on padding
    return {
        "mask": mask,
        "rewards": rewards,
        "values": randn(rows, steps),  # the critic writes numbers on padding too
        "scores": randn(rows),
        "logprobs": -randn(rows, steps).abs(),
        "old_logprobs": -randn(rows, steps).abs(),
        "ref_logprobs": -randn(rows, steps).abs(),
        "advantages": randn(rows, steps),
        "returns": randn(rows, steps),
        "logits": randn(rows, steps, 5) * 3,
    }


def rows_of(tensor: torch.Tensor) -> Rows:
    return tensor.tolist()


def assert_on_mask(actual: torch.Tensor, expected: Rows, mask: torch.Tensor) -> None:
    """Equal to 1e-6 on response tokens; zero on padding (our convention, see ``core``'s docstring)."""
    want = torch.tensor(expected, dtype=torch.float64)
    on = mask.bool()
    torch.testing.assert_close(actual[on], want[on], atol=ATOL, rtol=0)
    assert torch.all(actual[~on] == 0)


def ref_masked_mean(values: Rows, mask: Rows) -> float:
    total = sum(v * m for vr, mr in zip(values, mask, strict=True) for v, m in zip(vr, mr, strict=True))
    return total / (sum(map(sum, mask)) + 1e-8)


def ref_masked_whiten(values: Rows, mask: Rows) -> Rows:
    mean = ref_masked_mean(values, mask)
    count = sum(map(sum, mask))
    var = ref_masked_mean([[(v - mean) ** 2 for v in row] for row in values], mask) * count / (count - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def ref_gae(rewards: Rows, values: Rows, mask: Rows, gamma: float, lam: float) -> tuple[Rows, Rows]:
    """verl: the recursion skips masked tokens; returns = advantages + values; advantages whitened."""
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask, strict=True):
        next_value, last, row = 0.0, 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            delta = r[t] + gamma * next_value - v[t]
            new = delta + gamma * lam * last
            next_value = v[t] * m[t] + (1 - m[t]) * next_value
            last = new * m[t] + (1 - m[t]) * last
            row[t] = last
        advantages.append(row)
        returns.append([a + b for a, b in zip(row, v, strict=True)])
    return ref_masked_whiten(advantages, mask), returns


def groups(values: list[float], size: int) -> list[list[float]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def ref_grpo(scores: list[float], mask: Rows, size: int, norm_by_std: bool) -> Rows:
    out = []
    for group in groups(scores, size):
        mean, std = (0.0, 1.0) if size == 1 else (statistics.mean(group), statistics.stdev(group))
        out += [(s - mean) / (std + 1e-6) if norm_by_std else s - mean for s in group]
    return [[a * m for m in row] for a, row in zip(out, mask, strict=True)]


def ref_rloo(rewards: Rows, mask: Rows, size: int) -> Rows:
    out = []
    for group in groups([sum(row) for row in rewards], size):
        n = len(group)
        out += [s * n / (n - 1) - statistics.mean(group) * n / (n - 1) if n > 1 else s for s in group]
    return [[a * m for m in row] for a, row in zip(out, mask, strict=True)]


def ref_remax(rewards: Rows, baselines: list[float], mask: Rows) -> tuple[Rows, Rows]:
    returns = [[sum(r[k] * m[k] for k in range(t, len(r))) for t in range(len(r))]
               for r, m in zip(rewards, mask, strict=True)]
    advantages = [[g - b * mt for g, mt in zip(row, m, strict=True)]
                  for row, b, m in zip(returns, baselines, mask, strict=True)]
    return advantages, returns


def ref_reinforce_pp(rewards: Rows, mask: Rows, gamma: float) -> tuple[Rows, Rows]:
    """Current verl: a masked token keeps the running return (holes: ``test_modes_match_verl.py``)."""
    returns = []
    for r, m in zip(rewards, mask, strict=True):
        running, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            new = r[t] + gamma * running
            row[t] = new * m[t]
            running = new * m[t] + running * (1 - m[t])
        returns.append(row)
    whitened = ref_masked_whiten(returns, mask)
    return [[a * mt for a, mt in zip(row, m, strict=True)] for row, m in zip(whitened, mask, strict=True)], returns


def ref_reinforce_pp_baseline(rewards: Rows, mask: Rows, size: int) -> Rows:
    centred = []
    for group in groups([sum(row) for row in rewards], size):
        centred += [s - (statistics.mean(group) if size > 1 else 0.0) for s in group]
    tiled = [[c * mt for mt in m] for c, m in zip(centred, mask, strict=True)]
    return [[a * mt for a, mt in zip(row, m, strict=True)]
            for row, m in zip(ref_masked_whiten(tiled, mask), mask, strict=True)]


def ref_agg(loss: Rows, mask: Rows, mode: str) -> float:
    if mode == "token-mean":
        return ref_masked_mean(loss, mask)
    sums = [sum(v * m for v, m in zip(row, mr, strict=True)) for row, mr in zip(loss, mask, strict=True)]
    if mode == "seq-mean-token-sum":
        return statistics.mean(sums)
    return statistics.mean(s / sum(mr) for s, mr in zip(sums, mask, strict=True))


def ref_policy_loss(logp: Rows, old: Rows, adv: Rows, mask: Rows, low: float, high: float, c: float | None,
                    mode: str) -> tuple[float, float, float, float]:
    """verl's vanilla PPO loss; ``c=None`` drops the dual clip (the paper's objective)."""
    losses, clipped, lower, kl = [], [], [], []
    for lr, orow, arow in zip(logp, old, adv, strict=True):
        loss_row, clip_row, lower_row, kl_row = [], [], [], []
        for lp, o, a in zip(lr, orow, arow, strict=True):
            log_ratio = min(max(lp - o, -20.0), 20.0)
            ratio = math.exp(log_ratio)
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            clip_row.append(float(l2 > l1))
            lower_row.append(float(c is not None and loss > -a * c and a < 0))
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            loss_row.append(loss)
            kl_row.append(-log_ratio)
        losses.append(loss_row)
        clipped.append(clip_row)
        lower.append(lower_row)
        kl.append(kl_row)
    return (ref_agg(losses, mask, mode), ref_masked_mean(clipped, mask), ref_masked_mean(kl, mask),
            ref_masked_mean(lower, mask))


def ref_value_loss(vpreds: Rows, old: Rows, returns: Rows, mask: Rows, clip: float, mode: str) -> tuple[float, float]:
    losses, clipped = [], []
    for vr, orow, rr in zip(vpreds, old, returns, strict=True):
        loss_row, clip_row = [], []
        for v, o, r in zip(vr, orow, rr, strict=True):
            l1, l2 = (v - r) ** 2, (min(max(v, o - clip), o + clip) - r) ** 2
            loss_row.append(max(l1, l2))
            clip_row.append(float(l2 > l1))
        losses.append(loss_row)
        clipped.append(clip_row)
    return 0.5 * ref_agg(losses, mask, mode), ref_masked_mean(clipped, mask)


def ref_kl(logp: float, ref: float, kind: str) -> float:
    if kind in ("k1", "kl"):
        return logp - ref
    if kind == "abs":
        return abs(logp - ref)
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref) ** 2
    kl = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1, -10.0), 10.0)


def ref_entropy(logits: list[float]) -> float:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    probs = [w / sum(weights) for w in weights]
    return -sum(p * math.log(p) for p in probs if p > 0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(seed, gamma, lam):
    b = batch(seed)
    adv, ret = core.gae_advantages(b["rewards"], b["values"], b["mask"], gamma, lam, whiten=True)
    want_adv, want_ret = ref_gae(rows_of(b["rewards"]), rows_of(b["values"]), rows_of(b["mask"]), gamma, lam)
    assert_on_mask(adv, want_adv, b["mask"])
    assert_on_mask(ret, want_ret, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_skips_tokens_masked_inside_a_response(seed):
    """Multi-turn masks (tool output inside a response) are skipped as verl skips them."""
    b = batch(seed)
    mask = b["mask"].clone()
    mask[:, 2] = 0
    mask[0, 0] = 1  # keep every row non-empty
    adv, ret = core.gae_advantages(b["rewards"], b["values"], mask, 0.95, 0.9, whiten=False)
    want_adv, want_ret = ref_gae(rows_of(b["rewards"]), rows_of(b["values"]), rows_of(mask), 0.95, 0.9)
    whitened, _ = core.gae_advantages(b["rewards"], b["values"], mask, 0.95, 0.9, whiten=True)
    assert_on_mask(whitened, want_adv, mask)
    assert_on_mask(ret, want_ret, mask)
    assert_on_mask(adv, [[r - v for r, v in zip(rr, vr, strict=True)]
                         for rr, vr in zip(want_ret, rows_of(b["values"]), strict=True)], mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo(seed, size, norm_by_std):
    b = batch(seed)
    got = core.grpo_advantages(b["scores"], b["mask"], size, norm_by_std)
    assert_on_mask(got, ref_grpo(b["scores"].tolist(), rows_of(b["mask"]), size, norm_by_std), b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_rloo(seed, size):
    b = batch(seed)
    got = core.rloo_advantages(b["rewards"], b["mask"], size)
    assert_on_mask(got, ref_rloo(rows_of(b["rewards"]), rows_of(b["mask"]), size), b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_remax(seed):
    b = batch(seed)
    adv, ret = core.remax_advantages(b["rewards"], b["scores"], b["mask"])
    want_adv, want_ret = ref_remax(rows_of(b["rewards"]), b["scores"].tolist(), rows_of(b["mask"]))
    assert_on_mask(adv, want_adv, b["mask"])
    assert_on_mask(ret, want_ret, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp(seed, gamma):
    b = batch(seed)
    adv, ret = core.reinforce_pp_advantages(b["rewards"], b["mask"], gamma)
    want_adv, want_ret = ref_reinforce_pp(rows_of(b["rewards"]), rows_of(b["mask"]), gamma)
    assert_on_mask(adv, want_adv, b["mask"])
    assert_on_mask(ret, want_ret, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_reinforce_pp_baseline(seed, size):
    b = batch(seed)
    got = core.reinforce_pp_baseline_advantages(b["rewards"], b["mask"], size)
    assert_on_mask(got, ref_reinforce_pp_baseline(rows_of(b["rewards"]), rows_of(b["mask"]), size), b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize(("low", "high", "dual"), [(0.2, None, None), (0.2, 0.28, 3.0), (0.1, None, 1.5)])
def test_ppo_policy_loss(seed, mode, low, high, dual):
    b = batch(seed)
    # Spread the ratios so both clip bounds and the dual clip are hit.
    logprobs = b["old_logprobs"] + 1.5 * b["logprobs"].sin()
    loss, stats = core.ppo_policy_loss(logprobs, b["old_logprobs"], b["advantages"], b["mask"], low, high, dual, mode)
    want = ref_policy_loss(rows_of(logprobs), rows_of(b["old_logprobs"]), rows_of(b["advantages"]),
                           rows_of(b["mask"]), low, high if high is not None else low, dual, mode)
    got = (loss.item(), stats["clipfrac"].item(), stats["approx_kl"].item(), stats["clipfrac_lower"].item())
    assert got == pytest.approx(want, abs=ATOL)
    assert 0 < want[1] < 1  # the test hits the clip


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_value_loss(seed, mode):
    b = batch(seed)
    vpreds = b["values"] + 0.5 * b["advantages"]
    loss, stats = core.value_loss(vpreds, b["values"], b["returns"], b["mask"], 0.2, mode)
    want = ref_value_loss(rows_of(vpreds), rows_of(b["values"]), rows_of(b["returns"]), rows_of(b["mask"]), 0.2, mode)
    assert (loss.item(), stats["vf_clipfrac"].item()) == pytest.approx(want, abs=ATOL)
    unclipped, _ = core.value_loss(vpreds, b["values"], b["returns"], b["mask"], None, mode)
    squares = [[(v - r) ** 2 for v, r in zip(vr, rr, strict=True)]
               for vr, rr in zip(rows_of(vpreds), rows_of(b["returns"]), strict=True)]
    assert unclipped.item() == pytest.approx(0.5 * ref_agg(squares, rows_of(b["mask"]), mode), abs=ATOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators_and_kl_loss(seed, kind):
    b = batch(seed)
    logp, ref = b["logprobs"] * 4, b["ref_logprobs"] * 4  # wide enough for k3's clamp to bite
    got = core.kl_penalty(logp, ref, kind)
    want = [[ref_kl(p, r, kind) for p, r in zip(pr, rr, strict=True)] for pr, rr in zip(rows_of(logp), rows_of(ref),
                                                                                            strict=True)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=ATOL, rtol=0)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss = core.kl_loss(logp, ref, b["mask"], kind, mode)
        assert loss.item() == pytest.approx(ref_agg(want, rows_of(b["mask"]), mode), abs=ATOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_penalised_token_rewards(seed):
    b = batch(seed)
    got = core.kl_penalized_rewards(b["scores"], b["logprobs"], b["ref_logprobs"], b["mask"], 0.1, "k1")
    want = []
    for score, lp, rp, m in zip(b["scores"].tolist(), rows_of(b["logprobs"]), rows_of(b["ref_logprobs"]),
                                rows_of(b["mask"]), strict=True):
        last = int(sum(m)) - 1  # verl puts the score at valid_response_length - 1
        want.append([(score if t == last else 0.0) - 0.1 * (lp[t] - rp[t]) * m[t] for t in range(len(m))])
    assert_on_mask(got, want, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_and_logprobs_from_logits(seed):
    b = batch(seed)
    logits = b["logits"]
    want = [[ref_entropy(position) for position in row] for row in logits.tolist()]
    torch.testing.assert_close(core.entropy_from_logits(logits), torch.tensor(want, dtype=torch.float64),
                               atol=ATOL, rtol=0)
    labels = logits.argmin(dim=-1)
    got = core.logprobs_from_logits(logits, labels)
    for i, row in enumerate(logits.tolist()):
        for t, position in enumerate(row):
            log_z = math.log(sum(math.exp(x) for x in position))
            assert got[i, t].item() == pytest.approx(position[labels[i, t]] - log_z, abs=1e-5)  # float32 inside


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_mean_sum_and_whiten(seed):
    b = batch(seed)
    values, mask = b["advantages"], b["mask"]
    assert core.masked_mean(values, mask).item() == pytest.approx(ref_masked_mean(rows_of(values), rows_of(mask)))
    row_sums = [sum(v * m for v, m in zip(vr, mr, strict=True)) for vr, mr in zip(rows_of(values), rows_of(mask),
                                                                                   strict=True)]
    assert core.masked_sum(values, mask, dim=-1).tolist() == pytest.approx(row_sums, abs=ATOL)
    row_means = [s / sum(mr) for s, mr in zip(row_sums, rows_of(mask), strict=True)]
    assert core.masked_mean(values, mask, dim=-1).tolist() == pytest.approx(row_means, abs=ATOL)
    whitened = core.masked_whiten(values, mask)
    want = ref_masked_whiten(rows_of(values), rows_of(mask))
    torch.testing.assert_close(whitened[mask.bool()], torch.tensor(want, dtype=torch.float64)[mask.bool()],
                               atol=ATOL, rtol=0)
    unshifted = core.masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(unshifted - whitened, torch.full_like(values, ref_masked_mean(rows_of(values),
                                                                                             rows_of(mask))))
