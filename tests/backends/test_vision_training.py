"""Training a tiny Qwen2-VL (issue 41): a frozen vision tower (``freeze_vision_tower``) keeps its weights through an
update, holds no optimizer state and is left out of a weight sync, which a rollout built from the same model takes;
LoRA adapters go on the language model only."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import context, layout, role_spec, run_ranks
from vision_rows import image_rows

from hybridflow.graph import RoleKind
from hybridflow.models.vision import build_tiny_vlm, save_vlm_dir, tiny_vlm_processor
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import AdapterSpec, RoleSpec
from hybridflow.runtime.weights import full_weights

TOWER = "model.visual."  # the tiny model's tower, in HF state-dict names


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    processor = tiny_vlm_processor()
    return save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=0), processor, tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def update_rows(vlm_dir: Path) -> Batch:
    """Two image rows with the fields a PPO policy update reads (advantages of both signs)."""
    batch, _, _ = image_rows(vlm_dir)
    old = -4.6 + 0.1 * torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    return batch.union(Batch({"old_logprobs": old, "advantages": torch.tensor([[1.0] * 6, [-1.0] * 6])}))


def _engine(vlm_dir: Path, kind: RoleKind = RoleKind.POLICY, **changes: Any) -> Any:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    spec = dataclasses.replace(role_spec("actor" if kind.trainable else "rollout", kind), model=str(vlm_dir), **changes)
    return TorchRoleEngine(spec, layout(spec.name, dp=1, sharding="NO_SHARD", padding=True), context())


def _update(engine: Any, batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from hybridflow.registry import LOSSES

    before = {name: tensor.clone() for name, tensor in engine.iter_full_weights()}
    engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    return before, dict(engine.iter_full_weights())


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_vision_tower_keeps_its_weights_and_holds_no_optimizer_state(vlm_dir: Path, update_rows: Batch,
                                                                            frozen: bool) -> None:
    engine = _engine(vlm_dir, freeze_vision_tower=frozen)
    before, after = _update(engine, update_rows)
    moved = _moved(before, after)
    tower = {name for name in before if name.startswith(TOWER)}
    assert tower and any(not name.startswith(TOWER) for name in moved)  # the language model trained
    if frozen:
        assert not moved & tower
    else:  # the control: the same update moves the tower when it trains
        assert moved & tower
    optimized = {id(param) for group in engine.optimizer.param_groups for param in group["params"]}
    tower_params = [param for name, param in engine.model.named_parameters() if name.startswith(TOWER)]
    assert any(id(param) in optimized for param in tower_params) is not frozen
    assert all(param.grad is None for param in tower_params) is frozen


def test_a_sync_leaves_the_frozen_tower_out_and_the_rollout_keeps_its_own(vlm_dir: Path, update_rows: Batch) -> None:
    """The trainer ships its trained weights alone; a rollout built from the same model takes them (a partial load)
    and then holds exactly the trainer's whole weights."""
    trainer = _engine(vlm_dir, freeze_vision_tower=True)
    _update(trainer, update_rows)
    shipped = dict(full_weights(trainer, "fp32", trained_only=True))
    whole = dict(full_weights(trainer, "fp32"))
    assert not any(name.startswith(TOWER) for name in shipped)
    assert set(whole) - set(shipped) == {name for name in whole if name.startswith(TOWER)}
    rollout = _engine(vlm_dir, RoleKind.FROZEN_POLICY)
    rollout.load_weights(shipped.items())
    received = dict(rollout.iter_full_weights())
    assert set(received) == set(whole)
    assert all(torch.equal(received[name], whole[name]) for name in whole)
    # A trainer that trains its tower ships it.
    assert any(name.startswith(TOWER) for name, _ in full_weights(_engine(vlm_dir), "fp32", trained_only=True))
    with pytest.raises(KeyError, match="lacks"):  # a name the model does not have is still refused
        rollout.load_weights([("model.visual.nonexistent", torch.zeros(1))])


def test_freeze_vision_tower_is_refused_where_there_is_no_tower_or_nothing_trains() -> None:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    spec = dataclasses.replace(role_spec("actor", RoleKind.POLICY), freeze_vision_tower=True)  # a text model
    with pytest.raises(ValueError, match=r"freeze_vision_tower=True for role 'actor'.*no vision tower"):
        TorchRoleEngine(spec, layout("actor", dp=1, sharding="NO_SHARD"), context())
    with pytest.raises(ValueError, match="freeze_vision_tower is for a trainable role"):
        RoleSpec(name="ref", kind=RoleKind.FROZEN_POLICY, model="m", freeze_vision_tower=True)


def test_the_config_key_reaches_the_policys_spec_and_is_refused_on_a_reference() -> None:
    from hybridflow.train.config import config_from_dotted
    from hybridflow.train.setup import build_graph, role_specs

    def specs(**keys: Any) -> dict[str, RoleSpec]:
        config = config_from_dotted({"algorithm.options.kl_coef": 0.05, **keys})
        return role_specs(config, build_graph(config), "model-dir")

    frozen = specs(**{"roles.actor.freeze_vision_tower": True})
    assert frozen["actor"].freeze_vision_tower and not frozen["reference"].freeze_vision_tower
    assert not specs()["actor"].freeze_vision_tower  # verl's default: the tower trains
    assert specs(**{"actor_rollout_ref.actor.freeze_vision_tower": True})["actor"].freeze_vision_tower  # verl's key
    with pytest.raises(ValueError, match=r"'roles\.reference\.freeze_vision_tower'.*trains nothing"):
        specs(**{"roles.reference.freeze_vision_tower": True})


def test_a_run_plans_the_tower_as_the_config_freezes_it(vlm_dir: Path) -> None:
    from hybridflow.train.config import config_from_dotted
    from hybridflow.train.placement import role_models
    from hybridflow.train.setup import build_graph

    def trained(**keys: Any) -> dict[str, bool]:
        config = config_from_dotted({"algorithm.options.kl_coef": 0.05, **keys})
        return {role: model.trained_vision_params > 0
                for role, model in role_models(config, build_graph(config), str(vlm_dir)).items()}

    assert trained() == {"actor": True, "reference": False}
    assert trained(**{"roles.actor.freeze_vision_tower": True}) == {"actor": False, "reference": False}
    assert trained(**{"roles.actor.lora": {"rank": 4}}) == {"actor": False, "reference": False}


def test_lora_on_a_vlm_adapts_the_language_model_only(vlm_dir: Path, update_rows: Batch) -> None:
    engine = _engine(vlm_dir, lora=AdapterSpec(rank=4))
    layers = list(engine.adapter_layers)
    assert layers and all(".language_model." in name for name in layers)
    assert not any(".visual." in name for name, _ in engine.model.named_parameters() if ".lora_" in name)
    assert "exclude_modules" in engine.adapter_config() and engine.adapter_config()["exclude_modules"]
    before, after = _update(engine, update_rows)
    moved = _moved(before, after)
    assert moved and all(".language_model.layers." in name for name in moved)
    # The merged stream is the plain model's state dict, name for name.
    from transformers import AutoModelForImageTextToText

    assert set(after) == set(AutoModelForImageTextToText.from_pretrained(vlm_dir).state_dict())


def test_lora_targets_that_only_the_tower_has_are_refused(vlm_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear module of .*language model.*q_proj"):
        _engine(vlm_dir, lora=AdapterSpec(rank=4, target_modules=("qkv",)))


@pytest.mark.slow  # two spawned gloo ranks: ~40 s on 2 shared cores
def test_fsdp_updates_with_a_frozen_tower_keep_it_and_train_the_rest(vlm_dir: Path, update_rows: Batch) -> None:
    """FULL_SHARD over two ranks, an image row on each: the tower's weights stay, the language model's move, and the
    sync stream (gathered collectively) leaves the tower out."""
    import vision_ranks

    ranks = run_ranks(vision_ranks.fsdp_frozen_update, str(vlm_dir), update_rows.to_wire())
    before, after, shipped = ranks[0]["before"], ranks[0]["after"], ranks[0]["shipped"]
    moved = _moved(before, after)
    assert moved and not any(name.startswith(TOWER) for name in moved)
    assert set(shipped) == {name for name in before if not name.startswith(TOWER)}
    assert ranks[0]["tower_state"] == 0 and ranks[1]["tower_state"] == 0  # no optimizer state for the tower's shards


@pytest.mark.slow  # two spawned gloo ranks and DeepSpeed's start-up: 35 s, 200 s on a loaded 2-core box
def test_deepspeed_zero2_updates_a_vlm_as_the_torch_engine_and_keeps_a_frozen_tower(vlm_dir: Path,
                                                                                   update_rows: Batch) -> None:
    pytest.importorskip("deepspeed", reason="needs DeepSpeed (the `deepspeed` extra)")
    import vision_ranks

    for result in run_ranks(vision_ranks.deepspeed_zero2_updates, str(vlm_dir), update_rows.to_wire()):
        assert result["weight_gap"] < 1e-5  # one image row per rank: the torch engine's update over both
        assert result["trained"]["tower_moved"] > 0 and result["trained"]["text_moved"] > 0
        assert result["frozen"]["tower_moved"] == 0 and result["frozen"]["text_moved"] > 0
