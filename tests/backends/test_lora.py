"""LoRA adapters on the training backends: only adapters train and checkpoint, merged weights leave, resume exact."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft", reason="needs peft (the `lora` extra)")
import lora_ranks
import torch
from harness import context, layout, role_spec, rollout_batch, run_ranks
from hybridflow.backends.common.peft_lora import is_adapter_key
from hybridflow.backends.torch import TorchRoleEngine
from lora_ranks import ADAPTERS, lora_spec, steps

from hybridflow.graph import RoleKind
from hybridflow.runtime.protocols import AdapterSpec, RoleSpec


@pytest.fixture(scope="module")
def trained() -> TorchRoleEngine:
    """A torch LoRA policy after two updates (A moves from the second on: B starts at zero)."""
    engine = TorchRoleEngine(lora_spec(), layout(dp=1), context())
    steps(engine, rollout_batch(8, seed=2), 2)
    return engine


def test_only_the_adapters_train_and_sit_in_the_optimizer() -> None:
    engine = TorchRoleEngine(lora_spec(), layout(dp=1), context())
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    steps(engine, rollout_batch(8, seed=2), 2)
    assert engine.optimizer is not None
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    for name, param in engine.model.named_parameters():
        assert param.requires_grad == is_adapter_key(name), name
        assert (id(param) in optimized) == is_adapter_key(name), name
        if is_adapter_key(name):
            assert not torch.equal(param, before[name]), f"adapter {name} did not move"
        else:
            assert torch.equal(param, before[name]), f"base weight {name} moved"
    adapted = sum(p.numel() for name, p in engine.model.named_parameters() if is_adapter_key(name))
    assert 0 < adapted < 0.1 * sum(p.numel() for p in engine.model.parameters())


def test_merged_weights_are_peft_merge_and_unload(trained: TorchRoleEngine) -> None:
    merged = dict(trained.iter_full_weights())
    expected = copy.deepcopy(trained.model).merge_and_unload().state_dict()
    assert set(merged) == set(expected)  # HF names: no base_model.model. / .base_layer
    assert max(float((merged[n] - expected[n]).abs().max()) for n in expected) <= 1e-6
    base = TorchRoleEngine(role_spec(), layout(dp=1), context()).state_dict()
    assert any(not torch.equal(merged[n], base[n]) for n in base), "the adapters changed no merged weight"
    assert trained.tied_weights() == {"lm_head.weight": "model.embed_tokens.weight"}
    live = {p.data_ptr() for p in trained.model.parameters()}
    adapted = [n for n in merged if n.endswith("q_proj.weight")]
    assert adapted and all(merged[n].data_ptr() not in live for n in adapted), "merged in place"


def test_adapter_weights_and_config_are_peft_format(trained: TorchRoleEngine, tmp_path: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    adapters = dict(trained.iter_adapter_weights())
    expected = get_peft_model_state_dict(trained.model)
    assert set(adapters) == set(expected) and all(torch.equal(adapters[n], expected[n]) for n in expected)
    config = trained.adapter_config()
    assert config["r"] == ADAPTERS.rank and config["lora_alpha"] == ADAPTERS.alpha
    assert config["base_model_name_or_path"] == trained.spec.model
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in adapters.items()}, tmp_path / "adapter_model.safetensors")
    base = TorchRoleEngine(role_spec(), layout(dp=1), context()).model
    loaded = PeftModel.from_pretrained(base, str(tmp_path))  # what the sync/export paths will hand peft or vLLM
    batch = rollout_batch(4, seed=7)
    from hybridflow.backends.common.modeling import policy_outputs

    with torch.no_grad():
        gap = (policy_outputs(loaded, batch, with_entropy=False)["logprobs"]
               - trained.log_probs(batch)["logprobs"]).abs().max()
    assert float(gap) <= 1e-6


def test_base_log_probs_are_the_base_model_exactly(trained: TorchRoleEngine) -> None:
    batch = rollout_batch(6, seed=3)
    base = TorchRoleEngine(role_spec(), layout(dp=1), context())
    assert torch.equal(trained.log_probs(batch, adapters=False)["logprobs"], base.log_probs(batch)["logprobs"])
    assert not torch.equal(trained.log_probs(batch)["logprobs"], base.log_probs(batch)["logprobs"])
    with pytest.raises(ValueError, match=r"role 'actor' has no LoRA adapters"):
        base.log_probs(batch, adapters=False)


def test_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path: Path) -> None:
    batch = rollout_batch(8, seed=2)
    engine = TorchRoleEngine(lora_spec(), layout(dp=1), context())
    steps(engine, batch, 2)
    engine.save_checkpoint(str(tmp_path))
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert saved["model"] and all(is_adapter_key(name) for name in saved["model"])
    assert len(saved["optimizer"]["state"]) == len(saved["model"])
    whole = sum(t.numel() * t.element_size() for t in engine.state_dict().values())
    assert (tmp_path / "state.pt").stat().st_size < whole / 3
    steps(engine, batch, 2)
    fresh = TorchRoleEngine(lora_spec(), layout(dp=1), context())
    fresh.load_checkpoint(str(tmp_path))
    steps(fresh, batch, 2)
    uninterrupted, resumed = engine.state_dict(), fresh.state_dict()
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
    assert torch.equal(fresh.log_probs(batch)["logprobs"], engine.log_probs(batch)["logprobs"])


def test_whole_weights_are_refused_by_a_lora_policy(trained: TorchRoleEngine) -> None:
    with pytest.raises(TypeError, match="LoRA adapters"):
        trained.load_weights(trained.state_dict().items())


def test_a_policy_without_adapters_says_so() -> None:
    engine = TorchRoleEngine(role_spec(), layout(dp=1), context())
    assert not engine.has_adapters
    with pytest.raises(ValueError, match="no LoRA adapters"):
        engine.adapter_config()


@pytest.mark.parametrize(("changes", "field"), [({"rank": 0}, "lora.rank"), ({"alpha": 0.0}, "lora.alpha"),
                                                 ({"dropout": 1.0}, "lora.dropout"), ({"init": "magic"}, "lora.init"),
                                                 ({"target_modules": "q_proj"}, "lora.target_modules"),
                                                 ({"target_modules": []}, "lora.target_modules")])
def test_bad_adapter_settings_are_refused_by_name(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AdapterSpec(**changes)


def test_targets_that_match_no_module_list_the_linear_modules() -> None:
    spec = dataclasses.replace(role_spec(), lora=AdapterSpec(target_modules=("q_proj", "attn_qkv")))
    with pytest.raises(ValueError, match=r"role 'actor': lora\.target_modules \['attn_qkv'\].*q_proj.*v_proj"):
        TorchRoleEngine(spec, layout(dp=1), context())
    named = dataclasses.replace(role_spec(), lora=AdapterSpec(target_modules=["q_proj", "v_proj"]))
    engine = TorchRoleEngine(named, layout(dp=1), context())
    assert {name.split(".")[-4] for name, p in engine.model.named_parameters() if p.requires_grad} == {"q_proj",
                                                                                                      "v_proj"}


def test_lora_on_a_frozen_role_is_refused_naming_the_role() -> None:
    with pytest.raises(ValueError, match=r"role 'reference' \(frozen_policy\): lora trains adapters on a trainable"):
        RoleSpec(name="reference", kind=RoleKind.FROZEN_POLICY, model="tiny-qwen2", lora=ADAPTERS)


def test_fsdp_trains_adapters_only_and_resumes_exactly() -> None:
    _check_sharded(run_ranks(lora_ranks.sharded_checks, "fsdp", "FULL_SHARD"))


@pytest.mark.slow
def test_deepspeed_zero2_trains_adapters_only_and_resumes_exactly() -> None:
    pytest.importorskip("deepspeed", reason="needs DeepSpeed (the `deepspeed` extra)")
    _check_sharded(run_ranks(lora_ranks.sharded_checks, "deepspeed", "ZERO2"))


def _check_sharded(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["base_unchanged"] and result["adapters_moved"]
        assert result["optimized"] <= result["trainable"]  # sharded optimizers may hold a rank's part only
        assert result["merged_names"] and result["adapter_names"]
        assert result["merged_gap"] < 1e-5  # the torch engine on the whole batch: rounding of the gradient mean
        assert result["base_logprob_gap"] < 1e-5
        assert result["resume_exact"] and result["resume_logprobs_exact"]
    assert all(is_adapter_key(key) for key in ranks[0]["checkpoint_model_keys"])
    assert 0 < ranks[0]["checkpoint_bytes"] < ranks[0]["model_bytes"] / 3
