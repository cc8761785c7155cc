"""The auto planner on named scenarios: the seed case, mixed GPUs, CPU logical GPUs, scale, bad input."""

from __future__ import annotations

import time

import pytest

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, InfeasibleError, ModelSpec, Plan, PlannerOptions, plan_placement
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.search import set_partitions
from hybridflow.testing import check_plan


def test_seed_scenario_is_feasible_and_valid(ppo, llama_models, seed_workload):
    cluster = Cluster.parse("8xA100-80G")
    start = time.perf_counter()
    plan = plan_placement(PlanRequest(ppo, llama_models, seed_workload, cluster))
    assert time.perf_counter() - start < 30  # a guard against a search that blows up, not a speed target
    check_plan(plan, graph=ppo, cluster=cluster)
    assert plan.feasible and plan.step_time_s > 0 and plan.bottleneck
    assert plan.search is not None and plan.search.method.startswith("exact") and plan.search.candidates > 0
    assert {n.node for n in plan.nodes} == {n.name for n in ppo.nodes}
    assert Plan.from_json(plan.to_json()) == plan


def test_mixed_cluster_puts_the_reward_model_on_t4_in_fp16(ppo):
    models = {"actor": ModelSpec.preset("qwen2.5-7b"), "critic": ModelSpec.preset("qwen2.5-7b"),
              "reference": ModelSpec.preset("qwen2.5-7b"), "reward": ModelSpec.preset("qwen2.5-1.5b")}
    cluster = Cluster.parse("4xA100-80G+2xT4")
    workload = Workload(batch_size=1024, prompt_len=512, response_len=512)
    plan = plan_placement(PlanRequest(ppo, models, workload, cluster))
    check_plan(plan, graph=ppo, cluster=cluster)
    t4 = [g for g in plan.groups if g.device == "T4"]
    assert t4 and set(t4[0].roles) <= {"reward", "reference"}
    assert all(layout.dtype == "fp16" for layout in t4[0].layouts)
    trainers = {plan.groups[plan.group_index(r) or 0].device for r in ("actor", "critic")}
    assert trainers == {"A100-80G"} and plan.layout("actor").dtype == "bf16"


def test_cpu_logical_gpus_plan_tiny_models_for_the_runtime():
    graph = load_graph("ppo")
    tiny = ModelSpec.preset("tiny")
    models = dict.fromkeys(("actor", "critic", "reward", "reference"), tiny)
    for spec in ("2xCPU", "4xA100-80G", "1xCPU"):
        cluster = Cluster.parse(spec)
        plan = plan_placement(PlanRequest(graph, models, Workload(batch_size=4, prompt_len=8, response_len=8), cluster))
        check_plan(plan, graph=graph, cluster=cluster)
        for group in plan.groups:
            for layout in group.layouts:
                assert layout.micro_batch_size <= 8 and layout.dp * layout.tp == group.size
                assert layout.dtype == ("fp32" if spec.endswith("CPU") else "bf16")


def test_reward_function_goes_to_the_driver(llama_models, seed_workload):
    graph = load_graph("ppo", reward_kind="reward_function")
    models = {k: v for k, v in llama_models.items() if k != "reward"}
    plan = plan_placement(PlanRequest(graph, models, seed_workload, Cluster.parse("8xA100-80G")))
    assert plan.driver_roles == ("reward",) and "reward" not in [r for g in plan.groups for r in g.roles]
    assert plan.group_index("reward") is None


def test_large_clusters_search_whole_machines_quickly(ppo, llama_models):
    cluster = Cluster.parse("16x8xA100-80G+16x8xL40S")
    start = time.perf_counter()
    plan = plan_placement(PlanRequest(ppo, llama_models, Workload(batch_size=2048, prompt_len=512, response_len=512),
                                      cluster))
    assert time.perf_counter() - start < 10
    assert plan.search is not None and plan.search.method == "machine units"
    check_plan(plan, graph=ppo, cluster=cluster)
    for group in plan.groups:  # whole machines only
        assert group.size % 8 == 0 and len(set(group.hosts)) * 8 == group.size


def test_exact_and_machine_units_agree_when_machines_are_the_only_sensible_unit(ppo, llama_models, seed_workload):
    cluster = Cluster.parse("2x8xH100")
    exact = plan_placement(PlanRequest(ppo, llama_models, seed_workload, cluster), options=PlannerOptions(unit="gpu"))
    coarse = plan_placement(PlanRequest(ppo, llama_models, seed_workload, cluster),
                            options=PlannerOptions(unit="machine"))
    assert exact.step_time_s <= coarse.step_time_s * (1 + 1e-9)


def test_model_that_fits_nowhere_names_role_and_shortfall(ppo):
    huge = ModelSpec.preset("llama3-70b")
    models = dict.fromkeys(("actor", "critic", "reward", "reference"), huge)
    with pytest.raises(InfeasibleError, match=r"role 'actor' \(llama3-70b\) needs at least .* GiB.*over by"):
        plan_placement(PlanRequest(ppo, models, Workload(batch_size=8, prompt_len=128, response_len=128),
                                   Cluster.parse("2xT4")))


def test_roles_that_fit_alone_but_not_together_say_so(ppo):
    spec = ModelSpec.preset("qwen2.5-1.5b")
    models = dict.fromkeys(("actor", "critic", "reward", "reference"), spec)
    with pytest.raises(InfeasibleError, match="each role fits alone"):
        plan_placement(PlanRequest(ppo, models, Workload(batch_size=8, prompt_len=128, response_len=128),
                                   Cluster.parse("1xA100-40G")))


def test_bad_inputs_are_clear(ppo, llama_models, seed_workload):
    cluster = Cluster.parse("8xA100-80G")
    with pytest.raises(ValueError, match="no model for role 'reference'"):
        plan_placement(PlanRequest(ppo, {"actor": llama_models["actor"]}, seed_workload, cluster))
    with pytest.raises(ValueError, match="names role 'judge'"):
        plan_placement(PlanRequest(ppo, {**llama_models, "judge": llama_models["actor"]}, seed_workload, cluster))
    with pytest.raises(ValueError, match="batch_size=-1"):
        Workload(batch_size=-1, prompt_len=1, response_len=1)
    with pytest.raises(ValueError, match="unit='node'"):
        PlannerOptions(unit="node")


def test_set_partitions_of_four_roles():
    assert len(list(set_partitions(["actor", "critic", "reward", "reference"]))) == 15


def test_importing_the_planner_is_light(tmp_path):
    import subprocess
    import sys

    # What it imports, not how long that takes (a timed assert fails on a loaded machine; benchmarks time).
    code = ("import sys; import hybridflow.planner; "
            "print(sorted(m for m in ('torch', 'ray', 'scipy', 'rich', 'hypothesis') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.stdout.strip() == "[]", done.stderr
