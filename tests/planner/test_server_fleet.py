"""A rollout served by server replicas behind a router (``rollout: server``): the plan sizes and prices the fleet."""

from __future__ import annotations

import dataclasses

import pytest

from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import (
    Calibration,
    Cluster,
    InfeasibleError,
    LayoutSupport,
    ModelSpec,
    Plan,
    RoleLayout,
    plan_placement,
    rollout_role,
)
from hybridflow.planner.calibration import DEFAULT_CONSTANTS
from hybridflow.planner.costs import Shape
from hybridflow.planner.devices import get_device
from hybridflow.planner.fleet import (
    check_replicas,
    fleet_metrics,
    fleet_replicas,
    fleet_routers,
    fleet_sync,
    fleets,
    router_seconds,
)
from hybridflow.planner.manual import evaluate_mapping, parse_mapping
from hybridflow.planner.request import PlanRequest

ROLLOUT = rollout_role("actor")
SERVED = LayoutSupport(backend="vllm-server", served=True, max_rollout_tp=None, rollout_batch_size=True)
MODEL = ModelSpec.preset("qwen2.5-7b")


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo", reward_kind="reward_function")


def request(graph: Graph, *, batch: int = 256, served: bool = True, cluster: str = "2x8xH100",
            router_s: float | None = None) -> PlanRequest:
    calibration = None
    if router_s is not None:
        calibration = Calibration(default=dataclasses.replace(DEFAULT_CONSTANTS, router_request_s=router_s))
    return PlanRequest(graph, {"actor": MODEL, "reference": MODEL},
                       Workload(batch_size=batch, prompt_len=256, response_len=1024), Cluster.parse(cluster),
                       support={ROLLOUT: SERVED} if served else {}, calibration=calibration)


def manual(req: PlanRequest, mapping: str = "actor=0-7,reference=0-7,actor:rollout=8-15", rtp: int = 1) -> Plan:
    return evaluate_mapping(req, parse_mapping(mapping), rollout_tp={ROLLOUT: rtp})


def node(plan: Plan, name: str) -> float:
    return next(n.seconds for n in plan.nodes if n.node == name)


def test_the_fleet_is_the_rollout_layout_replicas_of_its_rollout_tp(grpo: Graph) -> None:
    for rtp, replicas in ((1, 8), (2, 4), (4, 2)):
        plan = manual(request(grpo), rtp=rtp)
        fleet = fleets(plan)[ROLLOUT]
        layout = plan.layout(ROLLOUT)
        assert (fleet["replicas"], fleet["tp"]) == (replicas, rtp) == (fleet_replicas(layout), layout.rollout_tp)
        assert plan.groups[int(fleet["group"])].roles == (ROLLOUT,)
    searched = plan_placement(request(grpo))
    fleet = fleets(searched)[ROLLOUT]
    group = searched.groups[int(fleet["group"])]
    assert "actor" not in group.roles  # never on the trainer's GPUs
    assert fleet["replicas"] * fleet["tp"] == group.size


def test_the_search_never_colocates_a_served_rollout_and_a_mapping_that_does_is_refused(grpo: Graph) -> None:
    assert not plan_placement(request(grpo, served=False)).detached_rollouts  # unserved: colocated wins here
    assert plan_placement(request(grpo)).detached_rollouts == {"actor": ROLLOUT}
    with pytest.raises(ValueError, match=r"role 'actor' generates through server replicas.*'actor:rollout=<GPUs"):
        manual(request(grpo), "actor=0-15,reference=0-15")
    with pytest.raises(InfeasibleError, match=r"rollout is served.*at least 2 GPUs in all, the cluster has 1"):
        plan_placement(request(grpo, cluster="1xH100"))


def test_more_replicas_send_more_copies_of_the_weights(grpo: Graph) -> None:
    shape = Shape(get_device("H100"), (8, 8), 25e9)
    sync = {dp: fleet_sync(MODEL, RoleLayout(role=ROLLOUT, dp=dp, dtype="bf16"), shape) for dp in (4, 8, 16)}
    assert sync[8][1] == 2 * sync[4][1] and sync[16][1] == 2 * sync[8][1]
    assert sync[4][0] < sync[8][0] < sync[16][0]
    copy = MODEL.params * 2
    assert sync[16][0] - sync[8][0] == pytest.approx(8 * copy / 25e9)  # each copy over the link, no relay tree
    small = manual(request(grpo), "actor=0-7,reference=0-7,actor:rollout=8-11")
    large = manual(request(grpo), "actor=0-7,reference=0-7,actor:rollout=8-15")
    assert fleets(large)[ROLLOUT]["sync_bytes"] == 2 * fleets(small)[ROLLOUT]["sync_bytes"]
    assert large.weight_sync_bytes - small.weight_sync_bytes == pytest.approx(4 * copy, rel=1e-6)


def test_the_router_costs_each_request(grpo: Graph) -> None:
    shape = Shape(get_device("H100"), (8,), 25e9)
    assert router_seconds(2000, shape) == pytest.approx(2 * router_seconds(1000, shape))
    assert router_seconds(1000, shape) == pytest.approx(1000 * 0.42e-3)
    assert router_seconds(1000, shape, routers=8) == pytest.approx(125 * 0.42e-3)  # one router per rank's replica
    added = {}
    for batch in (128, 256):
        base = node(manual(request(grpo, batch=batch, router_s=0.0)), "actor_generate")
        slow = manual(request(grpo, batch=batch, router_s=0.01))
        added[batch] = node(slow, "actor_generate") - base
        requests = Workload(batch_size=batch, prompt_len=256, response_len=1024).sequences(grpo)
        assert fleets(slow)[ROLLOUT]["requests"] == requests
        assert added[batch] == pytest.approx(requests * 0.01)  # one machine's GPUs: the role's one router
        assert fleets(slow)[ROLLOUT]["router_s"] == pytest.approx(added[batch])
    assert added[256] == pytest.approx(2 * added[128])
    one, two = (Shape(get_device("H100"), counts, 25e9) for counts in ((8,), (4, 4)))
    layout = RoleLayout(role=ROLLOUT, dp=8, dtype="bf16")
    assert fleet_routers(layout, one) == 1 and fleet_routers(layout, two) == 8  # across machines: a fleet per rank


def test_the_plan_round_trips_its_fleet_and_states_its_sync_estimate(grpo: Graph) -> None:
    plan = manual(request(grpo))
    again = Plan.from_json(plan.to_json())
    assert fleets(again) == fleets(plan)
    metrics = fleet_metrics(again)
    fleet = fleets(plan)[ROLLOUT]
    assert metrics == {"actor/rollout/sync_s_planned": fleet["sync_s"],
                       "actor/rollout/sync_bytes_planned": pytest.approx(MODEL.params * 2, rel=1e-6),
                       "actor/rollout/sync_replicas_planned": 8.0}
    assert fleet_metrics(plan_placement(request(grpo, served=False))) == {}


def test_replicas_that_disagree_with_the_plan_are_refused_naming_the_option() -> None:
    layout = RoleLayout(role=ROLLOUT, dp=8, dtype="bf16")
    assert check_replicas(None, layout, world_size=8, logical=False, role=ROLLOUT) == 1
    assert check_replicas(None, dataclasses.replace(layout, dp=4, tp=2, rollout_tp=1), world_size=1, logical=False,
                          role=ROLLOUT) == 8
    assert check_replicas(1, layout, world_size=8, logical=False, role=ROLLOUT) == 1
    assert check_replicas(2, layout, world_size=8, logical=True, role=ROLLOUT) == 2  # CPU processes share cores
    with pytest.raises(ValueError, match=r"role 'actor': its rollout option replicas=2 disagrees "
                                         r"with the plan.*8 server replica\(s\) over 8 rank\(s\), 1 per rank. Drop "
                                         r"the option"):
        check_replicas(2, layout, world_size=8, logical=False, role=ROLLOUT)
    tensor_parallel = dataclasses.replace(layout, dp=4, tp=1, rollout_tp=2)  # replicas of 2 GPUs each
    assert check_replicas(None, tensor_parallel, world_size=1, logical=False, role=ROLLOUT) == 2
    assert check_replicas(None, tensor_parallel, world_size=2, logical=True, role=ROLLOUT) == 1
    with pytest.raises(ValueError, match=r"role 'actor': its layout .*rollout_tp=2\) over 4 rank\(s\) gives each "
                                         r"rank 1 GPU\(s\), fewer than one server replica of tensor parallelism 2"):
        check_replicas(None, tensor_parallel, world_size=4, logical=True, role=ROLLOUT)
    # The role's one fleet: its rank 0 starts the whole plan's replicas, whatever the ranks.
    assert check_replicas(None, tensor_parallel, world_size=4, logical=False, role=ROLLOUT, pooled=True) == 2
    with pytest.raises(ValueError, match=r"replicas=4 disagrees .* 2 server replica\(s\) over 4 rank\(s\), 2 for the "
                                         r"role's one fleet"):
        check_replicas(4, tensor_parallel, world_size=4, logical=False, role=ROLLOUT, pooled=True)


def test_plan_prints_the_server_layout(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridflow.cli import main

    args = ["plan", "--algorithm", "grpo", "--cluster", "2x8xH100", "--model", "qwen2.5-7b", "--batch-size", "256",
            "--response-len", "1024", "--reward-kind", "reward_function", "--backend", "actor:rollout=server"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "rollout servers: actor:rollout:" in out and "server replicas x tp" in out
    assert "weight sync per update" in out and "1024 requests through 1 router(s)" in out
    assert main([*args, "--json"]) == 0
    fleet = fleets(Plan.from_json(capsys.readouterr().out))[ROLLOUT]
    # Replicas span ranks on one machine: fewer, wider replicas take fewer copies of the weights per update.
    assert fleet["tp"] > 1 and fleet["replicas"] * fleet["tp"] == 8 and fleet["routers"] == 1
