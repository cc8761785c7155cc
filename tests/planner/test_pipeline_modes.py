"""Execution modes in the planner: ``one_step_off`` overlaps a detached rollout with training (``modes.py``)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from hybridflow.cli import main
from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import Cluster, ExecutionMode, ModelSpec, Plan, PlannerOptions, plan_placement, rollout_role
from hybridflow.planner.costs import COLLECTIVE_LATENCY_S, DRIVER_SECONDS_PER_ROW
from hybridflow.planner.manual import evaluate_mapping, parse_mapping
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.weight_moves import WEIGHT_TENSOR_S
from hybridflow.testing import check_plan

ROLLOUT = rollout_role("actor")
SPLIT = f"actor=0-1,reference=0-1,{ROLLOUT}=2-3"
SMALL = "qwen2.5-0.5b"


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo", reward_kind="reward_function")


def small_models(graph: Graph, preset: str = SMALL) -> dict[str, ModelSpec]:
    return {role.name: ModelSpec.preset(preset) for role in graph.roles if role.kind.needs_gpu}


def cluster(spec: str = "4xA100-80G", *, instant_driver: bool = False) -> Cluster:
    parsed = Cluster.parse(spec)
    # A driver link this fast makes every transfer through the controller ~1e-12 s: the hand sum needs none.
    return dataclasses.replace(parsed, driver_bandwidth=1e21) if instant_driver else parsed


def seconds(plan: Plan, node: str) -> float:
    return next(n.seconds for n in plan.nodes if n.node == node)


@pytest.mark.parametrize("response_len", [64, 4096])
def test_one_step_off_step_is_the_slower_pool_by_hand(grpo: Graph, response_len: int) -> None:
    models, workload = small_models(grpo), Workload(batch_size=64, prompt_len=256, response_len=response_len)
    hardware = cluster(instant_driver=True)
    mapping = parse_mapping(SPLIT)
    sync = evaluate_mapping(PlanRequest(grpo, models, workload, hardware), mapping)
    overlapped = evaluate_mapping(PlanRequest(grpo, models, workload, hardware, pipeline="one_step_off"), mapping)
    assert (sync.pipeline, overlapped.pipeline) == ("sync", "one_step_off")
    # The rollout pool generates and then takes in the weights: one bf16 copy at the inter-node bandwidth.
    load = (models["actor"].params * 2 / hardware.inter_node_bandwidth + COLLECTIVE_LATENCY_S
            + models["actor"].weight_tensors * WEIGHT_TENSOR_S)  # the tensor-by-tensor loop
    generate = seconds(sync, "actor_generate") + load
    assert seconds(overlapped, "actor_generate") == pytest.approx(generate, rel=1e-9)
    # The trainer pool runs its nodes in turn on the batch generated during the step before; the driver's
    # reward and advantages (1 us a row each) overlap the reference and actor log-prob passes.
    trainer = (seconds(sync, "reference_ref_logprob") + seconds(sync, "actor_logprob")
               + seconds(sync, "actor_update"))
    assert 2 * workload.sequences(grpo) * DRIVER_SECONDS_PER_ROW < seconds(sync, "reference_ref_logprob")
    assert overlapped.step_time_s == pytest.approx(max(generate, trainer), rel=1e-9)
    assert sync.step_time_s == pytest.approx(seconds(sync, "actor_generate") + trainer, rel=1e-9)
    assert overlapped.weight_sync_seconds == pytest.approx(sync.weight_sync_seconds + load, rel=1e-9)
    check_plan(overlapped, graph=grpo, cluster=hardware)


@pytest.mark.parametrize("response_len", [32, 512, 4096])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_one_step_off_is_never_slower_than_the_same_split_in_sync(algorithm: str, response_len: int) -> None:
    graph = load_graph(algorithm, reward_kind="reward_function")
    models, workload = small_models(graph), Workload(batch_size=64, prompt_len=256, response_len=response_len)
    hardware = cluster("8xA100-80G")
    others = [role.name for role in graph.roles if role.kind.needs_gpu and role.name != "actor"]
    for rollout_gpus in range(1, 5):
        trainer = f"0-{7 - rollout_gpus}"
        text = ",".join([f"actor={trainer}", *(f"{role}={trainer}" for role in others),
                         f"{ROLLOUT}={8 - rollout_gpus}-7"])
        sync = evaluate_mapping(PlanRequest(graph, models, workload, hardware), parse_mapping(text))
        overlapped = evaluate_mapping(PlanRequest(graph, models, workload, hardware, pipeline="one_step_off"),
                                      parse_mapping(text))
        assert overlapped.step_time_s <= sync.step_time_s * (1 + 1e-9), text
        auto = evaluate_mapping(PlanRequest(graph, models, workload, hardware, pipeline="auto"), parse_mapping(text))
        assert auto.step_time_s == min(sync.step_time_s, overlapped.step_time_s)


def test_auto_picks_one_step_off_when_generation_dominates(grpo: Graph) -> None:
    models, hardware = small_models(grpo), cluster()
    # 32 prompts: the rollout's 4K drain dominates the step (at 64 the packed passes, their memory-bound ops priced,
    # catch up with it and the overlap's gain falls to ~1%).
    long = Workload(batch_size=32, prompt_len=256, response_len=4096)
    auto = plan_placement(PlanRequest(grpo, models, long, hardware, pipeline="auto"))
    sync = plan_placement(PlanRequest(grpo, models, long, hardware), options=PlannerOptions(separate_rollout=True))
    assert auto.pipeline == "one_step_off" and auto.detached_rollouts == {"actor": ROLLOUT}
    assert auto.step_time_s < sync.step_time_s * 0.9  # a real win, not a tie-break
    why = dict(auto.extra)["pipeline_choice"]
    assert why.startswith("one_step_off on 2+2 GPUs") and "sync colocated" in why and "overlaps training" in why
    check_plan(auto, graph=grpo, cluster=hardware)


def test_auto_keeps_sync_colocated_when_the_rollout_is_short(grpo: Graph) -> None:
    models, hardware = small_models(grpo), cluster()
    short = Workload(batch_size=64, prompt_len=256, response_len=32)
    auto = plan_placement(PlanRequest(grpo, models, short, hardware, pipeline="auto"))
    sync = plan_placement(PlanRequest(grpo, models, short, hardware))
    assert (auto.pipeline, auto.detached_rollouts) == ("sync", {})
    assert auto.step_time_s == sync.step_time_s
    assert dict(auto.extra)["pipeline_choice"].startswith("sync colocated on 4 GPUs")
    assert "one_step_off split" in dict(auto.extra)["pipeline_choice"]


def test_one_step_off_option_searches_only_split_plans(grpo: Graph) -> None:
    models, hardware = small_models(grpo), cluster()
    short = Workload(batch_size=64, prompt_len=256, response_len=32)
    plan = plan_placement(PlanRequest(grpo, models, short, hardware, pipeline="one_step_off"))
    assert plan.pipeline == "one_step_off" and plan.detached_rollouts == {"actor": ROLLOUT}
    assert plan.step_time_s >= plan_placement(PlanRequest(grpo, models, short, hardware)).step_time_s


def test_default_options_cost_sync_exactly_as_before(grpo: Graph) -> None:
    models, hardware = small_models(grpo), cluster()
    plan = plan_placement(PlanRequest(grpo, models, Workload(batch_size=64, prompt_len=256, response_len=4096),
                                      hardware))
    assert plan.pipeline == "sync" and "pipeline_choice" not in dict(plan.extra)


def test_colocated_mapping_with_one_step_off_is_refused_naming_the_fix(grpo: Graph) -> None:
    workload = Workload(batch_size=64, prompt_len=256, response_len=64)
    with pytest.raises(ValueError, match=r"needs the rollout of 'actor' on GPUs of its own.*"
                                         r"'actor:rollout=.*pipeline='sync'"):
        evaluate_mapping(PlanRequest(grpo, small_models(grpo), workload, cluster(), pipeline="one_step_off"),
                         parse_mapping("actor=0-3,reference=0-3"))
    # The policy's own GPUs named as its rollout are the colocated engine too.
    with pytest.raises(ValueError, match="GPUs of its own"):
        evaluate_mapping(PlanRequest(grpo, small_models(grpo), workload, cluster(), pipeline="one_step_off"),
                         parse_mapping(f"actor=0-3,reference=0-3,{ROLLOUT}=0-3"))


def test_graphs_the_runtime_cannot_overlap_are_refused() -> None:
    dapo = load_graph("dapo")  # its filter regenerates within the step
    models = small_models(dapo)
    workload = Workload(batch_size=64, prompt_len=256, response_len=64)
    with pytest.raises(ValueError, match=r"filter.*use pipeline='sync'"):
        plan_placement(PlanRequest(dapo, models, workload, cluster(), pipeline="one_step_off"))
    auto = plan_placement(PlanRequest(dapo, models, workload, cluster(), pipeline="auto"))
    assert auto.pipeline == "sync"


def test_bad_pipeline_values_name_the_field(grpo: Graph) -> None:
    with pytest.raises(ValueError, match=r"PlanRequest.pipeline='fully_async' must be one of"):
        PlanRequest(grpo, {}, Workload(batch_size=8, prompt_len=8, response_len=8), Cluster.parse("2xA100-80G"),
                    pipeline="fully_async")
    with pytest.raises(ValueError, match=r"ExecutionMode.pipeline='auto' must be one of \['sync', 'one_step_off', "
                                         r"'async'\]"):
        Plan(algorithm="grpo", groups=(), mode=ExecutionMode(pipeline="auto"))
    with pytest.raises(ValueError, match="pipeline='k2' must be one of"):
        evaluate_mapping(PlanRequest(grpo, small_models(grpo), Workload(batch_size=8, prompt_len=8, response_len=8),
                                     cluster(), pipeline="k2"), parse_mapping(SPLIT))


def test_one_step_off_needs_two_gpus(grpo: Graph) -> None:
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        plan_placement(PlanRequest(grpo, small_models(grpo), Workload(batch_size=8, prompt_len=8, response_len=8),
                                   cluster("1xA100-80G"), pipeline="one_step_off"))


def test_plan_json_round_trip_and_old_plans_load_as_sync(grpo: Graph) -> None:
    workload = Workload(batch_size=64, prompt_len=256, response_len=4096)
    plan = plan_placement(PlanRequest(grpo, small_models(grpo), workload, cluster(), pipeline="auto"))
    assert plan.pipeline == "one_step_off"
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["pipeline"] == "one_step_off"
    old = json.loads(plan.to_json())
    del old["pipeline"], old["max_staleness"]  # plans written before execution modes were costed
    assert (Plan.from_dict(old).pipeline, Plan.from_dict(old).max_staleness) == ("sync", 0)


def test_cli_plan_pipeline_auto_reports_the_mode(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--algorithm", "grpo", "--reward-kind", "reward_function", "--cluster", "4xA100-80G",
            "--model", SMALL, "--batch-size", "64", "--prompt-len", "256", "--response-len", "4096"]
    assert main([*args, "--pipeline", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    choice = data["extra"]["pipeline_choice"]
    split = re.match(r"one_step_off on (\d\+\d) GPUs", choice)
    assert data["pipeline"] == "one_step_off" and split, choice
    assert main([*args, "--pipeline", "auto"]) == 0
    assert f"execution mode: one_step_off on {split.group(1)} GPUs" in capsys.readouterr().out
    code = main([*args, "--pipeline", "one_step_off", "--manual", "actor=0-3,reference=0-3"])
    assert code != 0
