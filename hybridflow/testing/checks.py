"""``check_plan``: the invariants every plan must satisfy, as assertions that name what broke."""

from __future__ import annotations

from hybridflow.graph import Graph
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.devices import DEVICES
from hybridflow.planner.plan import Plan, detachable_policies


class PlanCheckError(AssertionError):
    """A plan broke an invariant."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PlanCheckError(message)


def check_plan(plan: Plan, *, graph: Graph | None = None, cluster: Cluster | None = None) -> None:
    """Assert the plan's invariants; with ``graph``/``cluster``, also check it against them.

    Every role placed exactly once; groups on disjoint, existing GPUs of their stated device; layouts
    that tile their group; dtypes the device runs; memory within capacity when feasible; a JSON round
    trip that gives the same plan; node times inside the step.
    """
    placed = [role for group in plan.groups for role in group.roles] + list(plan.driver_roles)
    _require(len(placed) == len(set(placed)), f"a role is placed twice: {placed}")
    if graph is not None:
        rollouts = plan.detached_rollouts
        roles = set(placed) - set(rollouts.values())
        _require(roles == set(graph.role_names), f"placed roles {sorted(roles)} != graph roles "
                                                 f"{sorted(graph.role_names)}")
        for policy in rollouts:
            _require(policy in detachable_policies(graph),
                     f"detached rollout of {policy!r}, which is not a trainable policy that generates")
        for role in plan.driver_roles:
            _require(not graph.role(role).kind.needs_gpu, f"driver role {role!r} needs a GPU")
    used = [gpu for group in plan.groups for gpu in group.gpus]
    _require(len(used) == len(set(used)), f"groups share GPUs: {[list(g.gpus) for g in plan.groups]}")
    for index in range(len(plan.groups)):
        _check_group(plan, index, cluster)
    if plan.feasible:
        _require(not plan.problems, f"a feasible plan lists problems: {plan.problems}")
    else:
        _require(bool(plan.problems), "an infeasible plan must say why (problems is empty)")
    for node in plan.nodes:
        _require(node.end_s <= plan.step_time_s * (1 + 1e-9) + 1e-12,
                 f"node {node.node} ends at {node.end_s} after the step ({plan.step_time_s})")
        _require(node.seconds >= 0 and node.start_s >= 0, f"node {node.node} has a negative time")
    _require(plan.step_time_s >= 0 and plan.cross_group_bytes >= 0, "negative step time or cross-group bytes")
    if len(plan.groups) == 1:
        _require(plan.cross_group_bytes == 0, "one group but cross-group bytes are not zero")
    _require(Plan.from_json(plan.to_json()) == plan, "the plan does not survive a JSON round trip")


def _check_group(plan: Plan, index: int, cluster: Cluster | None) -> None:
    group = plan.groups[index]
    where = f"group {index} ({', '.join(group.roles)})"
    _require(group.size > 0, f"{where} has no GPU")
    _require(group.device in DEVICES, f"{where}: unknown device {group.device!r}")
    device = DEVICES[group.device]
    for layout in group.layouts:
        _require(layout.dp * layout.tp == group.size,
                 f"{where}: {layout.role} dp={layout.dp} x tp={layout.tp} != {group.size} GPUs")
        _require(group.size % layout.rollout_tp == 0, f"{where}: {layout.role} rollout_tp={layout.rollout_tp} "
                                                      f"does not divide {group.size} GPUs")
        _require(device.supports(layout.dtype), f"{where}: {layout.role} runs {layout.dtype} on {group.device}, "
                                                f"which only runs {list(device.dtypes)}")
    if plan.feasible:
        _require(group.memory_per_gpu_bytes <= group.capacity_bytes,
                 f"{where} needs {group.memory_per_gpu_bytes} bytes per GPU, over its {group.capacity_bytes}")
    if cluster is not None:
        for gpu, host in zip(group.gpus, group.hosts, strict=True):
            _require(0 <= gpu < cluster.num_gpus, f"{where}: GPU {gpu} does not exist")
            machine = cluster.machine_of(gpu)
            _require(machine.device.name == group.device, f"{where}: GPU {gpu} is a {machine.device.name}, "
                                                          f"not a {group.device}")
            _require(machine.host == host, f"{where}: GPU {gpu} is on host {machine.host}, plan says {host}")
        _require(group.capacity_bytes == device.memory_bytes, f"{where}: capacity differs from the device's")
