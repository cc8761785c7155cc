"""LoRA in the planner: trainable weights from the shape, adapter-only memory and sync, the shared reference,
and a model too big for full fine-tuning planned with an adapter."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridflow.graph import Graph, RoleKind, Workload, load_graph
from hybridflow.planner import (
    Cluster,
    InfeasibleError,
    ModelSpec,
    Plan,
    PlannerOptions,
    RoleLayout,
    Sharding,
    evaluate_mapping,
    parse_mapping,
    plan_placement,
    rollout_role,
)
from hybridflow.planner.costs import Shape, state_bytes
from hybridflow.planner.devices import get_device
from hybridflow.planner.flops import flops_per_token
from hybridflow.planner.lora_costs import LoraPlan, sync_mode
from hybridflow.planner.models import from_config_dict
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.weight_moves import ADAPTER_LOAD_S, weight_ship, weight_sync
from hybridflow.testing import check_plan

LLAMA8 = ModelSpec.preset("llama3-8b")
LLAMA70 = ModelSpec.preset("llama3-70b")
A100 = Cluster.parse("8xA100-80G")
SHAPE = Shape(get_device("A100-80G"), (8,))


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo", reward_kind="reward_function")


def gpu_models(graph: Graph, model: ModelSpec) -> dict[str, ModelSpec]:
    return {role.name: model for role in graph.roles if role.kind.needs_gpu}


def peft_count(config: object, **lora: object) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    adapted = peft.get_peft_model(model, peft.LoraConfig(**lora))
    return sum(p.numel() for p in adapted.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj"), ("k_proj", "o_proj", "down_proj")])
def test_trainable_weights_match_peft_on_a_tiny_qwen2_with_grouped_query_attention(targets):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=128, tie_word_embeddings=True)
    spec = from_config_dict(config.to_dict(), name="tiny-qwen2")
    plan = LoraPlan(rank=8, target_modules=targets)
    expected = peft_count(config, r=8, target_modules=targets if isinstance(targets, str) else list(targets))
    assert plan.trainable_params(spec) == expected
    assert spec.with_adapter(plan).trainable_params == expected


def test_trainable_weights_match_peft_with_an_explicit_head_dim_and_an_untied_head():
    # Qwen3-like attention (heads x head_dim != hidden) and an untied lm_head, which all-linear leaves alone.
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, intermediate_size=80, vocab_size=128, tie_word_embeddings=False)
    spec = from_config_dict(config.to_dict(), name="tiny-qwen3")
    assert LoraPlan(rank=4).trainable_params(spec) == peft_count(config, r=4, target_modules="all-linear")


def test_the_formula_on_llama3_8b():
    # Per layer: q 4096->4096, k/v 4096->1024 (8 KV heads of 128), o 4096->4096, gate/up 4096->14336, down back.
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert LoraPlan(rank=16).trainable_params(LLAMA8) == 32 * per_layer == 41_943_040
    assert LoraPlan(rank=16, target_modules="q_proj+v_proj").trainable_params(LLAMA8) == 6_815_744


@pytest.mark.parametrize(("fields", "message"), [
    ({"rank": 0}, "rank=0"), ({"rank": 8, "target_modules": ("q_proj", "qq_proj")}, r"unknown \['qq_proj'\]"),
    ({"rank": 8, "dropout": 1.5}, "dropout=1.5"), ({"rank": 8, "sync": "delta"}, "sync='delta'")])
def test_bad_adapter_settings_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        LoraPlan(**fields)


def test_adapter_from_a_config_mapping_names_the_key():
    plan = LoraPlan.from_mapping({"rank": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
                                  "init": "gaussian"})
    assert (plan.rank, plan.target_modules, plan.dropout) == (16, ("q_proj", "v_proj"), 0.05)
    with pytest.raises(ValueError, match=r"roles.actor.lora: unknown keys \['ranks'\]"):
        LoraPlan.from_mapping({"ranks": 16}, where="roles.actor.lora")
    with pytest.raises(ValueError, match="'rank' is missing"):
        LoraPlan.from_mapping({"alpha": 16})
    assert LoraPlan.parse("rank=8,targets=q_proj+v_proj,sync=merged") == LoraPlan(
        rank=8, target_modules=("q_proj", "v_proj"), sync="merged")


def test_gradients_and_optimizer_states_are_the_adapters_and_the_base_stays_sharded():
    adapted = LLAMA8.with_adapter(LoraPlan(rank=16))
    adapter = adapted.adapter_params
    for sharding, shards in ((Sharding.NO_SHARD, (1, 1, 1)), (Sharding.SHARD_GRAD_OP, (1, 8, 8)),
                             (Sharding.FULL_SHARD, (8, 8, 8))):
        layout = RoleLayout(role="actor", dp=8, sharding=sharding)
        weights, grads, states = state_bytes(adapted, RoleKind.POLICY, layout, SHAPE)
        full = state_bytes(LLAMA8, RoleKind.POLICY, layout, SHAPE)
        assert weights == pytest.approx((LLAMA8.params + adapter) * 2 / shards[0])  # frozen base in bf16 + adapter
        assert grads == pytest.approx(adapter * 2 / shards[1])
        assert states == pytest.approx(adapter * 12 / shards[2])  # fp32 master + Adam m, v
        assert full[1] + full[2] > 150 * (grads + states)


def test_a_lora_update_skips_the_frozen_weights_gradients():
    adapted = LLAMA8.with_adapter(LoraPlan(rank=16))
    attention = 2 * LLAMA8.layers * LLAMA8.heads * LLAMA8.head_dim * 1024
    # The frozen matmuls (every weight but the input embedding) run forward and for input gradients; attention
    # forward and its 2.5x backward; the adapter all three passes.
    assert flops_per_token(adapted, 1024, 3, train=True) == pytest.approx(
        2 * 2 * (LLAMA8.params - LLAMA8.vocab * LLAMA8.hidden) + 3.5 * attention + 3 * 2 * adapted.adapter_params)
    assert flops_per_token(adapted, 1024, 1) == flops_per_token(LLAMA8, 1024, 1)  # forward passes: unchanged
    assert flops_per_token(LLAMA8, 1024, 3, train=True) == flops_per_token(LLAMA8, 1024, 3)


def test_sync_sends_the_adapter_to_vllm_and_the_merged_weights_otherwise():
    layout = RoleLayout(role="actor", dp=8, sharding=Sharding.FULL_SHARD, rollout_tp=2)
    adapter = LLAMA8.with_adapter(LoraPlan(rank=16, sync="adapter"))
    merged = LLAMA8.with_adapter(LoraPlan(rank=16, sync="merged"))
    seconds, sent = weight_ship(adapter, layout, SHAPE)
    assert sent == adapter.adapter_params * 2 and seconds > ADAPTER_LOAD_S
    assert weight_ship(merged, layout, SHAPE) == weight_ship(LLAMA8, layout, SHAPE)
    assert sent < 0.05 * weight_ship(merged, layout, SHAPE)[1]  # the target: < 5% of the full bytes
    assert weight_sync(adapter, layout, SHAPE)[1] == adapter.adapter_params * 2 // 2
    assert weight_sync(adapter, layout, SHAPE)[0] < weight_sync(merged, layout, SHAPE)[0] / 10
    assert sync_mode(LoraPlan(rank=8), "vllm") == "adapter" and sync_mode(LoraPlan(rank=8), "native") == "merged"


def test_a_detached_rollout_receives_only_the_adapter(grpo):
    workload = Workload(batch_size=64, prompt_len=256, response_len=256)
    mapping = parse_mapping(f"actor=0-3,reference=0-3,{rollout_role('actor')}=4-7")
    runs = {sync: evaluate_mapping(PlanRequest(grpo, gpu_models(grpo, LLAMA8), workload, A100, pipeline="one_step_off",
                                               lora=LoraPlan(rank=16, sync=sync)), mapping)
            for sync in ("adapter", "merged")}
    adapter = LLAMA8.with_adapter(LoraPlan(rank=16)).adapter_params
    assert runs["adapter"].weight_sync_bytes == adapter * 2
    assert runs["merged"].weight_sync_bytes == LLAMA8.params * 2
    assert runs["adapter"].weight_sync_seconds < runs["merged"].weight_sync_seconds / 10
    assert "adapter-only" in dict(runs["adapter"].extra)["lora"]
    assert "merged full weights" in dict(runs["merged"].extra)["lora"]


def test_the_shared_reference_holds_no_weights_and_runs_on_the_policys_gpus(grpo):
    workload = Workload(batch_size=64, prompt_len=256, response_len=256)
    models = gpu_models(grpo, LLAMA8)
    lora = LoraPlan(rank=16)
    own = evaluate_mapping(PlanRequest(grpo, models, workload, A100, lora=lora),
                           parse_mapping("actor=0-7,reference=0-7"), sharding=None)
    shared = evaluate_mapping(PlanRequest(grpo, models, workload, A100, lora=lora,
                                          shared_weights={"reference": "actor"}), parse_mapping("actor=0-7"),
                              sharding=None)
    check_plan(shared, graph=grpo, cluster=A100)
    assert Plan.from_json(shared.to_json()) == shared
    (group,) = shared.groups
    assert set(group.roles) == {"actor", "reference"}
    reference, actor = shared.layout("reference"), shared.layout("actor")
    assert reference.shares_weights_with == "actor" and own.layout("reference").shares_weights_with == ""
    assert dataclasses.replace(reference, role="actor", shares_weights_with="") == actor
    ref_node = next(node for node in shared.nodes if node.node == "reference_ref_logprob")
    assert ref_node.seconds > 0 and ref_node.role == "actor"  # its forward still costs time, on the actor's engine
    # No second copy of the base: at least the reference's smallest share of its weights is gone.
    assert own.groups[0].memory_per_gpu_bytes - group.memory_per_gpu_bytes >= LLAMA8.params * 2 / 8 * 0.99
    assert "reference run(s) on its engine" in dict(shared.extra)["lora"]
    with pytest.raises(ValueError, match=r"runs on 'actor'.s weights"):
        evaluate_mapping(PlanRequest(grpo, models, workload, A100, lora=lora, shared_weights={"reference": "actor"}),
                         parse_mapping("actor=0-3,reference=4-7"))
    with pytest.raises(ValueError, match=r"PlanRequest.shared_weights=.* needs lora"):
        evaluate_mapping(PlanRequest(grpo, models, workload, A100, shared_weights={"reference": "actor"}),
                         parse_mapping("actor=0-7"))


def test_seventy_b_does_not_fit_full_fine_tuning_on_8xa100_and_plans_with_lora(grpo):
    workload = Workload(batch_size=64, prompt_len=512, response_len=512)
    models = gpu_models(grpo, LLAMA70)
    with pytest.raises(InfeasibleError) as error:
        plan_placement(PlanRequest(grpo, models, workload, A100))
    message = str(error.value)
    assert "full fine-tuning: gradients" in message and "optimizer states" in message
    assert "rank-16 LoRA adapter" in message and "which fits" in message and "--lora rank=16" in message
    request = PlanRequest(grpo, models, workload, A100, lora=LoraPlan(rank=16), shared_weights={"reference": "actor"})
    options = PlannerOptions(lora_when="needed")
    plan = plan_placement(request, options=options)
    check_plan(plan, graph=grpo, cluster=A100)
    assert plan.feasible and all(g.memory_per_gpu_bytes <= 0.9 * g.capacity_bytes for g in plan.groups)
    why = dict(plan.extra)["lora"]
    assert why.startswith("full fine-tuning fits nowhere") and "planned with LoRA" in why
    assert "trains 207.1M of 70.55B weights" in why
    assert plan.layout("reference").shares_weights_with == "actor"
    always = plan_placement(request, options=dataclasses.replace(options, lora_when="always"))
    assert always.step_time_s == plan.step_time_s and always.groups == plan.groups


def test_eight_b_fits_both_ways_and_needed_keeps_full_fine_tuning(grpo):
    workload = Workload(batch_size=64, prompt_len=512, response_len=512)
    models = gpu_models(grpo, LLAMA8)
    full = plan_placement(PlanRequest(grpo, models, workload, A100))
    needed = plan_placement(PlanRequest(grpo, models, workload, A100, lora=LoraPlan(rank=16)),
                            options=PlannerOptions(lora_when="needed"))
    assert dataclasses.replace(needed, extra=full.extra, search=None) == dataclasses.replace(full, search=None)
    assert "full fine-tuning fits" in dict(needed.extra)["lora"]
    lora = plan_placement(PlanRequest(grpo, models, workload, A100, lora=LoraPlan(rank=16)))
    check_plan(lora, graph=grpo, cluster=A100)
    assert full.feasible and lora.feasible
    assert lora.step_time_s < full.step_time_s  # no weight gradients, a tiny optimizer step
    update = {plan: next(n.seconds for n in plan.nodes if n.node == "actor_update") for plan in (full, lora)}
    assert update[lora] < update[full]
    assert "per GPU gradients" in dict(lora.extra)["lora"]


def test_plans_without_lora_are_unchanged(grpo, ppo, llama_models, seed_workload):
    plain = plan_placement(PlanRequest(ppo, llama_models, seed_workload, A100))
    none = plan_placement(PlanRequest(ppo, llama_models, seed_workload, A100, lora=None))
    assert dataclasses.replace(none, search=None) == dataclasses.replace(plain, search=None)
    assert "lora" not in dict(plain.extra)
    assert all(layout.shares_weights_with == "" for group in plain.groups for layout in group.layouts)


def test_lora_on_a_frozen_role_is_refused(grpo):
    with pytest.raises(ValueError, match="only a trainable GPU role trains an adapter"):
        plan_placement(PlanRequest(grpo, gpu_models(grpo, LLAMA8),
                                   Workload(batch_size=8, prompt_len=64, response_len=64), A100,
                                   lora={"reference": LoraPlan(rank=8)}))


def test_cli_plans_lora_and_shares_the_reference(capsys):
    from hybridflow.cli import main

    args = ["plan", "--algorithm", "grpo", "--reward-kind", "reward_function", "--cluster", "8xA100-80G", "--model",
            "llama3-70b", "--batch-size", "64", "--json"]
    assert main(args) == 1
    assert "--lora rank=16" in capsys.readouterr().err
    assert main([*args, "--lora", "rank=16,targets=all-linear"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"] and "207.1M" in data["extra"]["lora"]
    layouts = {lay["role"]: lay for group in data["groups"] for lay in group["layouts"]}
    assert layouts["reference"]["shares_weights_with"] == "actor"
    assert main([*args, "--lora", "rank=16,reference=own,sync=merged"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert {lay["role"]: lay for g in own["groups"] for lay in g["layouts"]}["reference"]["shares_weights_with"] == ""
    assert "merged" in own["extra"]["lora"] or "in place" in own["extra"]["lora"]
    assert main([*args, "--lora", "rank=16,alpah=32"]) != 0
    assert "--lora: unknown keys ['alpah']" in capsys.readouterr().err
    assert main([*args, "--lora", "rank=16,when=sometimes"]) != 0
    assert "when='sometimes'" in capsys.readouterr().err


def test_train_config_lora_reaches_the_planner(grpo):
    from hybridflow.train.config import PlacementConfig, RoleConfig, TrainConfig
    from hybridflow.train.placement import planned, role_adapters, role_models, shared_references

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RoleWithLora(RoleConfig):  # the trainers' ``roles.<name>.lora`` key, before it lands in RoleConfig
        lora: dict | None = None

    config = TrainConfig(placement=PlacementConfig(mode="auto", cluster="2xCPU"),
                         roles={"actor": RoleWithLora(lora={"rank": 8, "alpha": 16}, rollout="vllm")})
    adapters = role_adapters(config, grpo)
    assert adapters == {"actor": LoraPlan(rank=8, sync="adapter")}
    assert shared_references(config, grpo, role_models(config, grpo), adapters) == {"reference": "actor"}
    plan = planned(config, grpo, prompt_len=16)
    assert plan.layout("reference").shares_weights_with == "actor"
    assert "LoRA rank 8" in dict(plan.extra)["lora"]
    native = dataclasses.replace(config, roles={"actor": RoleWithLora(lora={"rank": 8})})
    assert role_adapters(native, grpo)["actor"].sync == "merged"  # the native rollout takes merged weights
    assert role_adapters(TrainConfig(), grpo) == {}  # no key: full fine-tuning, as before
    # What the vLLM rollout runs: merged weights when asked, or when vLLM cannot take the adapter alone.
    merged = dataclasses.replace(config, roles={"actor": RoleWithLora(lora={"rank": 8}, rollout="vllm",
                                                                      rollout_options={"lora_sync": "merged"})})
    assert role_adapters(merged, grpo)["actor"].sync == "merged"
    pissa = dataclasses.replace(config, roles={"actor": RoleWithLora(lora={"rank": 8, "init": "pissa"},
                                                                     rollout="vllm")})
    assert role_adapters(pissa, grpo)["actor"].sync == "merged"
    with pytest.raises(ValueError, match=r"'roles.actor.lora'.*rank"):
        role_adapters(dataclasses.replace(config, roles={"actor": RoleWithLora(lora={"rank": 0})}), grpo)
