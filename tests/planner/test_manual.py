"""Manual mappings: parsing, validation errors, OOM reports, and the comparison with the auto plan."""

from __future__ import annotations

import pytest

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec, Sharding, plan_placement
from hybridflow.planner.compare import compare_plans
from hybridflow.planner.manual import evaluate_mapping, parse_mapping
from hybridflow.planner.request import PlanRequest
from hybridflow.testing import check_plan

from .conftest import SEED_MAPPING


def test_parse_mapping_reads_ranges_and_joins():
    assert parse_mapping("actor=0-3,reward=4+6-7") == {"actor": (0, 1, 2, 3), "reward": (4, 6, 7)}


@pytest.mark.parametrize(("text", "message"), [
    ("actor=0-3,actor=4-5", "lists role 'actor' twice"),
    ("actor", "must look like ROLE=FIRST-LAST"),
    ("actor=a-b", "is not a GPU id"),
    ("actor=3-1", "FIRST <= LAST"),
    ("", "empty"),
])
def test_parse_mapping_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mapping(text)


@pytest.fixture(scope="module")
def seed(ppo, llama_models, seed_workload):
    cluster = Cluster.parse("8xA100-80G")
    return ppo, llama_models, seed_workload, cluster


@pytest.mark.parametrize(("mapping", "message"), [
    ("actor=0-3,critic=2-5,reward=6-7,reference=6-7", r"share GPUs \[2, 3\] but not all"),
    ("actor=0-3,critic=0-3,reward=4-5,reference=4-9", "role 'reference' is mapped to GPU 8, which does not exist"),
    ("actor=0-3,critic=0-3,reward=4-5", r"leaves roles \['reference'\] without GPUs"),
    ("actor=0-3,critic=0-3,reward=4-5,reference=4-5,judge=6", "names role 'judge'"),
])
def test_bad_mappings_say_why(seed, mapping, message):
    with pytest.raises(ValueError, match=message):
        evaluate_mapping(PlanRequest(*seed), parse_mapping(mapping))


def test_mixed_device_group_is_rejected(ppo, llama_models, seed_workload):
    cluster = Cluster.parse("4xA100-80G+2xT4")
    with pytest.raises(ValueError, match="spans device types"):
        evaluate_mapping(PlanRequest(ppo, llama_models, seed_workload, cluster),
                         parse_mapping("actor=0-3,critic=0-3,reward=3-5,reference=3-5"))


def test_seed_mapping_is_costed_and_compared(seed):
    manual = evaluate_mapping(PlanRequest(*seed), parse_mapping(SEED_MAPPING), sharding=Sharding.FULL_SHARD)
    check_plan(manual, graph=seed[0], cluster=seed[3])
    assert [set(g.roles) for g in manual.groups] == [{"actor", "critic"}, {"reward", "reference"}]
    assert manual.cross_group_bytes > 0 and manual.search is not None and manual.search.method == "manual"
    auto = plan_placement(PlanRequest(*seed))
    assert auto.step_time_s < manual.step_time_s
    text = compare_plans(auto, manual)
    assert "auto is" in text and "faster" in text and "bottleneck" in text and "GPUs used 6" in text


def test_manual_oom_is_reported_not_raised(seed):
    graph, models, workload, cluster = seed
    manual = evaluate_mapping(PlanRequest(graph, models, workload, cluster),
                              parse_mapping("actor=0,critic=0,reward=1,reference=1"), sharding=None)
    assert not manual.feasible
    assert any("OOM risk" in p and "over by" in p and "['actor', 'critic']" in p for p in manual.problems)
    check_plan(manual, graph=graph, cluster=cluster)
    assert "does not fit" in compare_plans(plan_placement(PlanRequest(*seed)), manual)


def test_manual_knobs_are_honoured_and_checked(seed):
    manual = evaluate_mapping(PlanRequest(*seed, micro_batch_sizes={"actor": 4}), parse_mapping(SEED_MAPPING),
                              data_parallel_size=2, sharding="SHARD_GRAD_OP")
    actor = manual.layout("actor")
    assert (actor.dp, actor.tp, actor.sharding, actor.micro_batch_size) == (2, 2, Sharding.SHARD_GRAD_OP, 4)
    assert manual.layout("reference").sharding is Sharding.NO_SHARD  # frozen: nothing but params to shard
    with pytest.raises(ValueError, match="data_parallel_size=3 does not divide role 'actor'"):
        evaluate_mapping(PlanRequest(*seed), parse_mapping(SEED_MAPPING), data_parallel_size=3)


def test_dtype_the_device_lacks_is_an_error(ppo):
    tiny = ModelSpec.preset("qwen2.5-0.5b")
    models = dict.fromkeys(("actor", "critic", "reward", "reference"), tiny)
    cluster = Cluster.parse("4xA100-80G+2xT4")
    workload = Workload(batch_size=64, prompt_len=128, response_len=128)
    mapping = parse_mapping("actor=0-3,critic=0-3,reward=4-5,reference=4-5")
    plan = evaluate_mapping(PlanRequest(ppo, models, workload, cluster), mapping)
    assert plan.layout("reward").dtype == "fp16" and plan.layout("actor").dtype == "bf16"
    with pytest.raises(ValueError, match="dtype bf16 does not run on T4"):
        evaluate_mapping(PlanRequest(ppo, models, workload, cluster), mapping, dtypes={"reward": "bf16"})


def test_reward_function_runs_on_the_driver(llama_models, seed_workload):
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {"actor": llama_models["actor"], "reference": llama_models["reference"]}
    cluster = Cluster.parse("8xA100-80G")
    plan = evaluate_mapping(PlanRequest(graph, models, seed_workload, cluster),
                            parse_mapping("actor=0-5,reference=6-7"))
    assert plan.driver_roles == ("reward",)
    with pytest.raises(ValueError, match="runs on the driver"):
        evaluate_mapping(PlanRequest(graph, models, seed_workload, cluster),
                         parse_mapping("actor=0-5,reference=6-7,reward=7"))
