"""Global normalisation: the shares of any split of a mini batch add up to the mini batch's loss and gradient.

A mini batch is cut into micro batches (and the micro batches dealt to data-parallel ranks, which is the
same cut seen from farther away); each micro batch may be trimmed to its own longest response, as a
backend that packs or trims padding would. Summing every micro batch's share, computed with the mini
batch's :class:`LossNorm`, must equal the one-pass aggregate to 1e-6 relative, value and gradient.
"""

from __future__ import annotations

import pytest
import torch
from hybridflow.algorithms import core, functions

from hybridflow.registry import LOSSES

ROWS, STEPS = 9, 7
MODES = core.LOSS_AGGS
SPLITS = [[9], [1] * 9, [2, 2, 2, 2, 1], [4, 5], [3, 1, 5]]


def ragged_mask(seed: int) -> torch.Tensor:
    """Right-padded rows of random lengths, one row without padding, one fully masked (a padding row)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, STEPS + 1, (ROWS,), generator=gen)
    lengths[0], lengths[4] = STEPS, 0
    return (torch.arange(STEPS)[None, :] < lengths[:, None]).double()


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def micro_batches(sizes: list[int]) -> list[slice]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def trimmed(mask: torch.Tensor) -> int:
    """How many columns a micro batch keeps when trimmed to its longest response (at least one)."""
    return max(int(mask.sum(dim=-1).max()), 1)


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().clamp(min=1e-12)
    assert ((actual - expected).abs().max() / scale).item() < 1e-6


def test_loss_norm_counts_tokens_non_empty_rows_and_the_horizon():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert core.loss_norm(mask) == core.LossNorm(tokens=3, seqs=2, horizon=3)
    assert core.loss_norm(mask, horizon=32).horizon == 32
    parts = [core.loss_norm(mask[:1]), core.loss_norm(mask[1:, :1])]
    assert core.sum_loss_norms(parts) == core.LossNorm(tokens=3, seqs=2, horizon=3)


@pytest.mark.parametrize(("field", "kwargs"), [("tokens", {"tokens": -1.0, "seqs": 1, "horizon": 4}),
                                               ("seqs", {"tokens": 1, "seqs": float("nan"), "horizon": 4}),
                                               ("horizon", {"tokens": 1, "seqs": 1, "horizon": 0})])
def test_a_bad_loss_norm_names_its_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"LossNorm\.{field}="):
        core.LossNorm(**kwargs)
    with pytest.raises(ValueError, match="at least one"):
        core.sum_loss_norms([])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("seed", range(3))
def test_shares_of_any_split_add_up_to_the_one_pass_loss_and_gradient(mode, sizes, seed):
    mask = ragged_mask(seed)
    loss_mat = randn(seed + 100, ROWS, STEPS).requires_grad_()
    whole = core.aggregate_loss(loss_mat, mask, mode)
    (want_grad,) = torch.autograd.grad(whole, loss_mat)
    norm = core.loss_norm(mask)
    total = loss_mat.new_zeros(())
    for rows in micro_batches(sizes):
        keep = trimmed(mask[rows])
        total = total + core.aggregate_loss(loss_mat[rows, :keep], mask[rows, :keep], mode, norm)
    (got_grad,) = torch.autograd.grad(total, loss_mat)
    assert_close_relative(total.detach(), whole.detach())
    assert_close_relative(got_grad, want_grad)
    assert torch.all(got_grad[mask == 0] == 0)


def policy_batch(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    mask = ragged_mask(seed)
    batch = {"response_mask": mask, "old_logprobs": -randn(seed, ROWS, STEPS).abs(),
             "ref_logprobs": -randn(seed + 1, ROWS, STEPS).abs(), "advantages": randn(seed + 2, ROWS, STEPS),
             "values": randn(seed + 3, ROWS, STEPS), "returns": randn(seed + 4, ROWS, STEPS)}
    # Ratios far enough from 1 that the clips bite on some tokens and not on others.
    live = (batch["old_logprobs"] + 0.3 * randn(seed + 5, ROWS, STEPS)).requires_grad_()
    return batch, live


LOSS_CASES = [
    ("ppo_policy", {"clip_ratio_high": 0.28, "dual_clip": 3.0, "kl_coef": 0.1, "kl_type": "k3+",
                    "entropy_coef": 0.01}),
    ("ppo_policy", {"loss_scale_factor": 5}),
    ("gspo_policy", {"clip_ratio": 0.05, "clip_ratio_high": 0.1, "kl_coef": 0.1, "entropy_coef": 0.01}),
    ("value", {"clip_range": 0.2}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("loss_name", "options"), LOSS_CASES)
def test_registered_losses_split_into_shares(mode, loss_name, options):
    assert functions.ppo_policy is LOSSES.get("ppo_policy")
    loss_fn = LOSSES.get(loss_name)
    batch, live = policy_batch(7)
    key = "values" if loss_name == "value" else "logprobs"
    if key == "values":
        live = (batch["values"] + 0.5 * batch["advantages"]).detach().requires_grad_()
    entropy = randn(8, ROWS, STEPS).abs().requires_grad_()

    def run(rows: slice, keep: int, norm: core.LossNorm | None) -> torch.Tensor:
        fields = {name: tensor[rows, :keep] for name, tensor in batch.items()}
        outputs = {key: live[rows, :keep], "entropy": entropy[rows, :keep]}
        return loss_fn(outputs=outputs, batch=fields, loss_agg=mode, norm=norm, **options)[0]

    whole = run(slice(None), STEPS, None)
    want = torch.autograd.grad(whole, (live, entropy), allow_unused=True)
    norm = core.loss_norm(batch["response_mask"])
    total = sum(run(rows, trimmed(batch["response_mask"][rows]), norm) for rows in micro_batches([2, 4, 3]))
    assert isinstance(total, torch.Tensor)
    got = torch.autograd.grad(total, (live, entropy), allow_unused=True)
    assert_close_relative(total.detach(), whole.detach())
    for got_grad, want_grad in zip(got, want, strict=True):
        if want_grad is not None:
            assert got_grad is not None
            assert_close_relative(got_grad, want_grad)


def test_a_mini_batch_without_tokens_has_a_zero_loss_not_nan():
    mask = torch.zeros(2, 3, dtype=torch.float64)
    norm = core.loss_norm(mask)
    for mode in MODES:
        for given in (None, norm):
            assert core.aggregate_loss(torch.ones(2, 3, dtype=torch.float64), mask, mode, given).item() == 0
