"""The torch backend's data-parallel gradients live in one fp32 buffer that the all-reduce runs on in place."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from hybridflow.runtime.collective import _reducible_in_place


def test_gradients_are_views_of_one_buffer_that_backward_accumulates_into() -> None:
    from hybridflow.backends.torch.engine import flat_gradients

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    flat = flat_gradients(list(model.parameters()))
    assert flat is not None and flat.numel() == sum(p.numel() for p in model.parameters()) + 1  # + the flag
    x = torch.randn(5, 3)
    model(x).sum().backward()
    once = flat.clone()
    model(x).sum().backward()  # a second micro batch accumulates in place, into the same storage
    assert torch.allclose(flat, 2 * once) and float(once[:-1].abs().sum()) > 0
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
    assert float(flat[:-1].abs().sum()) == 0.0


def test_mixed_or_half_precision_parameters_keep_their_own_gradients() -> None:
    from hybridflow.backends.torch.engine import flat_gradients

    assert flat_gradients(list(torch.nn.Linear(3, 4).to(torch.bfloat16).parameters())) is None
    assert flat_gradients([]) is None


def test_only_a_lone_contiguous_fp32_tensor_is_reduced_in_place() -> None:
    assert _reducible_in_place(torch.zeros(4), "cpu")
    assert not _reducible_in_place(torch.zeros(4, dtype=torch.float64), "cpu")  # sums of counts stay float64
    assert not _reducible_in_place(torch.zeros(4, 2).t(), "cpu")


@pytest.mark.timeout(120)
def test_overlapped_bucket_reduce_equals_one_pass_and_a_non_finite_rank_stops_both() -> None:
    """dp 2 on gloo, 4 micro batches a rank: the buckets summed during the last backward give one pass's gradient
    over the whole mini batch (one bucket, and many); a NaN loss in one rank's last micro batch (no backward
    there) makes both ranks raise, the other rank's started buckets met by the stopped rank's."""
    results = run_ranks(__import__("overlap_ranks").overlap_results)
    for result in results:
        gaps = {key: gap for key, gap in result.items() if key.startswith("buckets")}
        assert len(gaps) == 2 and max(int(key.removeprefix("buckets")) for key in gaps) > 3, gaps
        assert max(gaps.values()) < 1e-5, gaps
        assert all(result[key.replace("buckets", "overlapped")] >= 1 for key in gaps), result  # during backward
        assert result["non_finite"] == "NonFiniteLossError"
