"""Logical CPU GPUs sharing their host's cores (``Cluster.host_cores``): processor sharing in the schedule."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.cli import main
from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import (
    Calibration,
    Cluster,
    LengthDistribution,
    ModelSpec,
    Plan,
    PlannerOptions,
    RunSettings,
    plan_placement,
)
from hybridflow.planner.calibration import Constants
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.problem import build_problem
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.schedule import (
    DRIVER,
    Schedule,
    Sharing,
    lower_bound,
    shared_step,
    shared_timeline,
    timeline,
)
from hybridflow.testing import brute_force_step_time, check_plan

TINY = "tiny-qwen2"


def schedule(groups: list[int], preds: list[list[tuple[int, float]]], *, overlapped: tuple[bool, ...] = (),
             max_staleness: int | None = None) -> Schedule:
    return Schedule(nodes=tuple(f"n{i}" for i in range(len(groups))), group_of=tuple(groups),
                    preds=tuple(tuple(p) for p in preds), driver_seconds=tuple(0.5 if g == DRIVER else 0.0
                                                                                for g in groups),
                    cross_group_bytes=0, num_groups=max(groups) + 1, overlapped=overlapped,
                    max_staleness=max_staleness)


def test_sharing_is_only_built_where_a_host_has_more_gpus_than_cores() -> None:
    assert Sharing.of(Cluster.parse("3xCPU"), [[0, 1, 2]]) is None  # no host_cores: a core each
    assert Sharing.of(Cluster.parse("3xCPU", host_cores=3), [[0, 1, 2]]) is None
    shared = Sharing.of(Cluster.parse("3xCPU", host_cores=2), [[0], [1, 2]])
    assert shared == Sharing(cores=(2,), devices=((1,), (2,)))
    assert Sharing.of_counts(Cluster.parse("3xCPU", host_cores=2), [[1], [2]]) == shared
    assert shared.rates([0, 1]) == {0: pytest.approx(2 / 3), 1: pytest.approx(2 / 3)}
    assert shared.rates([1]) == {1: 1.0}


def test_concurrent_groups_share_two_cores_by_hand() -> None:
    """A (2 GPUs, 3 s) and B (1 GPU, 1 s) start together on 2 cores: both run at 2/3 until B ends at 1.5 s,
    when A has 2 s of work left at full speed: A ends at 3.5 s. C (after A, on B's GPU, 1 s) runs alone."""
    plan = schedule([0, 1, 1], [[], [], [(0, 0.25)]])
    sharing = Sharing(cores=(2,), devices=((2,), (1,)))
    spans = shared_timeline(plan, [3.0, 1.0, 1.0], sharing)
    assert spans == [pytest.approx((0.0, 3.5)), pytest.approx((0.0, 1.5)), pytest.approx((3.75, 4.75))]
    assert timeline(plan, [3.0, 1.0, 1.0]) == [(0.0, 3.0), (0.0, 1.0), (3.25, 4.25)]
    assert shared_timeline(plan, [3.0, 1.0, 1.0], None) == timeline(plan, [3.0, 1.0, 1.0])


def test_one_group_of_three_on_two_cores_runs_at_two_thirds() -> None:
    plan = schedule([0, DRIVER, 0], [[], [(0, 0.0)], [(1, 0.0)]])
    spans = shared_timeline(plan, [2.0, 0.0, 1.0], Sharing(cores=(2,), devices=((3,),)))
    assert spans == [pytest.approx((0.0, 3.0)), pytest.approx((3.0, 3.5)), pytest.approx((3.5, 5.0))]


def test_async_latency_stretches_with_its_overlapped_generation() -> None:
    """The overlapped generate (group 1, 2 GPUs, 2 s) shares 2 cores with the trainer's 2 s node: both at 2/3
    until 3 s. The batch latency (4 s alone) stretches by the generation's 1.5x: (6 + 3) / 2 = 4.5."""
    plan = schedule([1, 0], [[], [(0, 0.0)]], overlapped=(True, False), max_staleness=1)
    sharing = Sharing(cores=(2,), devices=((1,), (2,)))
    spans, step, latency = shared_step(plan, [2.0, 2.0], 4.0, sharing)
    assert latency == pytest.approx(6.0)
    assert spans == [pytest.approx((0.0, 3.0)), pytest.approx((0.0, 3.0))]
    assert step == pytest.approx(max(3.0, 3.0, (4.0 * 1.5 + 3.0) / 2))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 2), st.floats(0.0, 5.0), st.booleans()), min_size=1, max_size=8),
       st.integers(1, 4), st.lists(st.integers(0, 3), min_size=3, max_size=3), st.floats(0.0, 3.0))
def test_the_bound_the_search_prunes_with_holds_shared_or_not_and_never_falls(
        nodes: list[tuple[int, float, bool]], cores: int, sizes: list[int], slower: float) -> None:
    """The search prunes with ``lower_bound``: no node of the schedule ends after the step it bounds, with or
    without shared cores, and it never falls when a node slows (a first-come queue's makespan may)."""
    groups = [g for g, _, _ in nodes]
    if max(groups) < 0:
        groups[0] = 0
    preds = [[(j, 0.1) for j in range(i) if nodes[i][2] and (i + j) % 2] for i in range(len(nodes))]
    plan = schedule(groups, preds)
    sharing = Sharing(cores=(cores,), devices=tuple((size,) for size in sizes))
    seconds = [s for _, s, _ in nodes]
    bound = lower_bound(plan, seconds)
    assert bound <= max(end for _, end in timeline(plan, seconds)) + 1e-9
    assert bound <= max(end for _, end in shared_timeline(plan, seconds, sharing)) + 1e-9
    for i in range(len(seconds)):
        assert lower_bound(plan, [s + slower * (j == i) for j, s in enumerate(seconds)]) >= bound - 1e-9


def test_a_group_takes_its_nodes_as_they_become_ready() -> None:
    """gen (group 0) feeds a driver node (1 s) and a log-prob pass (group 1, 2 s); a judge pass on group 1 waits for
    the driver node. The log-prob pass is ready first, so it runs first, though the judge comes first in the graph's
    order: the runtime submits each node the moment its inputs exist."""
    plan = Schedule(nodes=("gen", "render", "judge", "logprob"), group_of=(0, DRIVER, 1, 1),
                    preds=((), ((0, 0.0),), ((1, 0.0),), ((0, 0.0),)), driver_seconds=(0.0, 1.0, 0.0, 0.0),
                    cross_group_bytes=0, num_groups=2)
    seconds = [1.0, 0.0, 3.0, 2.0]
    assert timeline(plan, seconds) == [(0.0, 1.0), (1.0, 2.0), (3.0, 6.0), (1.0, 3.0)]
    sharing = Sharing(cores=(2,), devices=((1,), (1,)))  # a core each: nothing slows
    assert shared_timeline(plan, seconds, sharing) == [pytest.approx(span) for span in timeline(plan, seconds)]
    assert lower_bound(plan, seconds) == 6.0 == max(end for _, end in timeline(plan, seconds))  # gen, logprob, judge


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo_no_ref", reward_kind="reward_function")


def cpu_case() -> tuple[dict[str, ModelSpec], Workload, RunSettings]:
    models = {"actor": ModelSpec.preset(TINY)}
    return models, Workload(batch_size=8, prompt_len=16, response_len=56, n_samples=8), RunSettings(
        lengths=LengthDistribution.lognormal(mean=56, max=160))


def test_three_logical_gpus_on_two_cores_cost_what_they_share(grpo: Graph) -> None:
    models, workload, recipe = cpu_case()
    own, shared = Cluster.parse("3xCPU"), Cluster.parse("3xCPU", host_cores=2)
    colocated = {"actor": [0, 1, 2]}
    alone = evaluate_mapping(PlanRequest(grpo, models, workload, own, settings=recipe), colocated)
    sharing = evaluate_mapping(PlanRequest(grpo, models, workload, shared, settings=recipe), colocated)
    busy = sum(n.seconds for n in alone.nodes if n.group is not None)  # one group: its nodes run in turn
    assert sharing.step_time_s == pytest.approx(alone.step_time_s + busy / 2, rel=1e-9)  # GPU nodes at 2/3
    # Split over 1 + 2 GPUs, sync: never more than two GPUs busy at once, so nothing to share.
    split = {"actor": [0], "actor:rollout": [1, 2]}
    def cost(cluster: Cluster, mode: str = "sync") -> float:
        return evaluate_mapping(PlanRequest(grpo, models, workload, cluster, settings=recipe, pipeline=mode),
                                split).step_time_s

    assert cost(shared) == pytest.approx(cost(own))
    # Overlapped, all three are busy while both pools run: dearer than with a core each.
    for mode in ("one_step_off", "async"):
        assert cost(shared, mode) > cost(own, mode)


@pytest.mark.parametrize("pipeline", ["sync", "one_step_off", "async"])
def test_search_with_shared_cores_equals_brute_force(grpo: Graph, pipeline: str) -> None:
    models, workload, recipe = cpu_case()
    cluster = Cluster.parse("3xCPU", host_cores=2)
    detach = () if pipeline == "sync" else ("actor",)
    problem = build_problem(grpo, models, workload, cluster, detach=detach, settings=recipe, pipeline=pipeline,
                            max_staleness=2 if pipeline == "async" else None)
    plan = plan_placement(PlanRequest(grpo, models, workload, cluster, settings=recipe, pipeline=pipeline,
                                      max_staleness=2 if pipeline == "async" else None))
    assert plan.step_time_s == pytest.approx(brute_force_step_time(problem), rel=1e-9)
    check_plan(plan, graph=grpo, cluster=cluster)


def test_bad_host_cores_name_the_field(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="host_cores=0 must be a positive integer"):
        Cluster.parse("3xCPU", host_cores=0)
    with pytest.raises(ValueError, match="host_cores=True"):
        dataclasses.replace(Cluster.parse("3xCPU"), host_cores=True)


def test_cli_plan_takes_host_cores(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--algorithm", "grpo_no_ref", "--model", TINY, "--batch-size", "8", "--prompt-len", "16",
            "--response-len", "56", "--max-response-len", "160", "--n-samples", "8", "--json",
            "--reward-kind", "reward_function", "--manual", "actor=0-2"]
    assert main([*args, "--cluster", "3xCPU"]) == 0
    alone = capsys.readouterr().out
    assert main([*args, "--cluster", "3xCPU", "--host-cores", "2"]) == 0
    shared = capsys.readouterr().out
    # GPU nodes at 2/3 speed; the step overhead and the driver's work do not share.
    assert json.loads(alone)["step_time_s"] < json.loads(shared)["step_time_s"] < 1.5 * json.loads(alone)["step_time_s"]


def test_a_node_after_an_overlapped_generate_on_its_group_waits_for_it() -> None:
    """One_step_off with another node on the rollout's GPUs: it runs after the generation, not beside it."""
    plan = schedule([1, 0, 1], [[], [(0, 0.0)], [(1, 0.0)]], overlapped=(True, False, False))
    seconds = [2.0, 1.0, 1.0]
    assert timeline(plan, seconds) == [(0.0, 2.0), (0.0, 1.0), (2.0, 3.0)]
    spans = shared_timeline(plan, seconds, Sharing(cores=(2,), devices=((1,), (2,))))
    # 0 and 1 share 2 cores at 2/3 until 1 ends at 1.5 s; 0 then has 1 s left alone: ends at 2.5 s.
    assert spans == [pytest.approx((0.0, 2.5)), pytest.approx((0.0, 1.5)), pytest.approx((2.5, 3.5))]


# The CPU calibration benchmarks/pipeline_modes.py fitted to its sync runs (docs/benchmarks.md, pooled), with
# train_mfu refitted (0.157 -> 0.4145) when the model learnt how those runs ran: they predate packing (padded rows,
# prompt + max tokens each) and CPU attention computes its whole masked row (DeviceSpec.varlen_attention). The
# refit keeps the sync step the fitted calibration reproduced (0.898 s on this workload); the rest is unchanged.
CPU_CALIBRATION = Calibration(default=Constants(train_mfu=0.4145, eff_half_tokens=290.0, decode_mfu=0.1,
                                                decode_step_overhead_s=0.00227), source="pipeline_modes (sync runs)")


def test_auto_picks_the_mode_and_split_measured_fastest_on_three_cpu_gpus(grpo: Graph) -> None:
    """The benchmark's workload on 3 logical GPUs sharing 2 cores: measured, async k=2 with the trainer on 2
    GPUs and the rollout on 1 was fastest, then async k=1, one_step_off, and sync last."""
    models = {"actor": ModelSpec.preset(TINY)}
    workload = Workload(batch_size=8, prompt_len=10, response_len=56, n_samples=8)
    recipe = RunSettings(lengths=LengthDistribution.lognormal(mean=56, max=160), padding=True)  # as they ran
    cluster = Cluster.parse("3xCPU", host_cores=2)

    def best(pipeline: str, max_staleness: int | None = None) -> Plan:
        return plan_placement(PlanRequest(grpo, models, workload, cluster, settings=recipe, calibration=CPU_CALIBRATION,
                                          pipeline=pipeline, max_staleness=max_staleness),
                              options=PlannerOptions(separate_rollout=True, max_tp=1))

    auto = best("auto")
    assert (auto.pipeline, auto.max_staleness) == ("async", 2)
    assert {group.roles: len(group.gpus) for group in auto.groups} == {("actor",): 2, ("actor:rollout",): 1}
    steps = [best("async", 2).step_time_s, best("async", 1).step_time_s, best("one_step_off").step_time_s,
             best("sync").step_time_s]
    assert steps == sorted(steps) and steps[0] < 0.85 * steps[-1]
