"""What the controller refuses before it runs a step, each with the fix: a plan it cannot place, a layout a
role's backend would not run as planned, streaming the graph cannot do, and an engine that lacks a capability
its role's nodes need."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hybridflow.graph import Graph, Op, RoleKind
from hybridflow.planner import LayoutSupport, Plan, detachable_policies
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.modes import check_stream_chunks
from hybridflow.registry import BACKENDS
from hybridflow.runtime.engines import rollout_factory
from hybridflow.runtime.executor import WorkerGroup
from hybridflow.runtime.protocols import (
    OP_CAPABILITIES,
    AdapterModel,
    AdapterSink,
    RoleSpec,
    Scorer,
    TurnGenerator,
    WeightSink,
    WeightSource,
)


def role_support(spec: RoleSpec) -> LayoutSupport:
    """The layouts ``spec``'s role runs as planned.

    A frozen policy on a standalone rollout engine (a detached vLLM rollout) runs what that engine declares;
    any other role its backend's ``support``, generating with its rollout engine's tensor parallelism (a
    factory's ``max_rollout_tp`` where it declares one, else the backend's). A backend or factory that
    declares no ``support`` runs the plainest layouts: one replica per rank.
    """
    factory = rollout_factory(spec.rollout, role=spec.name)
    if factory.standalone and spec.kind is RoleKind.FROZEN_POLICY:
        return getattr(factory, "support", None) or LayoutSupport(backend=f"rollout {spec.rollout}")
    support = getattr(BACKENDS.get(spec.backend), "support", None) or LayoutSupport(backend=spec.backend)
    if hasattr(factory, "max_rollout_tp"):  # else the backend's own engine generates: its declaration holds
        support = replace(support, max_rollout_tp=factory.max_rollout_tp, rollout_follows_tp=False)
    return support


def check_layouts(graph: Graph, plan: Plan, specs: Mapping[str, RoleSpec]) -> None:
    """Refuse, before any engine is built, a plan layout its role's backend would not run as planned, naming
    the role, the fields and the backend."""
    generating = {plan.runs_on(str(node.role), generates=True) for node in graph.nodes if node.op is Op.GENERATE}
    found = []
    for group in plan.groups:
        for layout in group.layouts:
            spec = specs.get(layout.role)
            if spec is None:
                continue  # check_placement / the executor name a role without a spec
            problems = role_support(spec).problems(layout, generates=layout.role in generating)
            if problems:
                found.append(f"role {layout.role!r} (backend {spec.backend!r}): {'; '.join(problems)}")
    if found:
        raise ValueError("the plan asks for layouts its backends do not run as planned: " + " | ".join(found)
                         + ". Plan for these backends (an auto placement searches only what they run; "
                         "`hybridflow plan --backend ROLE=NAME` for a dry run) or choose a backend that runs them "
                         "(the role's backend)")


def check_placement(graph: Graph, plan: Plan, driver_roles: Mapping[str, Scorer]) -> None:
    """Every role is placed once (or scored on the driver), detached rollouts belong to a trainable policy on
    GPUs of their own, and every layout is one the backends run."""
    for policy, rollout in plan.detached_rollouts.items():
        if policy not in detachable_policies(graph):
            raise ValueError(f"plan role {rollout!r}: only a trainable policy that generates can have a rollout on "
                             f"GPUs of its own, and {policy!r} is not one in the {graph.name} graph")
        if plan.group_index(rollout) == plan.group_index(policy):
            raise ValueError(f"plan role {rollout!r} shares {policy!r}'s group: a rollout on the policy's own GPUs "
                             f"is the ordinary colocated one; drop {rollout!r} from the plan")
    for role in graph.roles:
        if role.kind is RoleKind.REWARD_FUNCTION or role.name in plan.driver_roles:
            if role.name not in driver_roles:
                raise KeyError(f"role {role.name!r} runs on the driver but no scorer was given for it; pass "
                               f"driver_roles={{{role.name!r}: scorer}}")
        else:
            plan.group_index(role.name)  # raises, naming the plan's roles, if it is not placed
    for group in plan.groups:
        for layout in group.layouts:
            split = {name: getattr(layout, name) for name in ("sp", "pp", "ep") if getattr(layout, name) != 1}
            if split:
                raise ValueError(f"plan: role {layout.role!r} has {split}; the runtime's backends run data (and "
                                 "rollout tensor) parallel layouts only: plan with sp = pp = ep = 1")
            if layout.dp * layout.tp != group.size:
                raise ValueError(f"plan: role {layout.role!r} has dp={layout.dp} x tp={layout.tp} but its group has "
                                 f"{group.size} GPUs; dp * tp must equal the group size")


def check_streaming(graph: Graph, mode: ExecutionMode) -> bool:
    """Whether steps stream (``mode.stream_chunks`` > 1); raises naming what stands in the way (the planner's
    rule, which costs the same streamed steps)."""
    check_stream_chunks(graph, mode)
    return mode.stream_chunks > 1


def held_capabilities(groups: list[WorkerGroup]) -> dict[str, set[str]]:
    """Per role, the capability protocols every rank's engine of it satisfies (``protocols.capabilities_of``)."""
    held: dict[str, set[str]] = {}
    for group in groups:
        for rank in group.capabilities():
            for role, names in rank.items():
                held[role] = held.get(role, set(names)) & set(names)  # what every rank of the role has
    return held


def adapter_shipping(plan: Plan, held: dict[str, set[str]]) -> dict[str, bool]:
    """Per policy with a detached rollout: whether its updates travel as the LoRA adapter alone (the trainer has
    adapters and every rollout rank takes them), else as whole (merged) weights."""
    return {policy: AdapterModel.__name__ in held.get(policy, set())
            and AdapterSink.__name__ in held.get(rollout, set())
            for policy, rollout in plan.detached_rollouts.items()}


def check_capabilities(graph: Graph, plan: Plan, groups: list[WorkerGroup]) -> dict[str, set[str]]:
    """Every engine can do what its role's nodes ask of it (and a detached rollout's weights can travel); returns
    what each role holds (:func:`held_capabilities`)."""
    held = held_capabilities(groups)
    needs: list[tuple[str, str, type]] = [(plan.runs_on(str(node.role), generates=node.op is Op.GENERATE),
                                           node.op.value, OP_CAPABILITIES[node.op])
                                          for node in graph.nodes if node.op in OP_CAPABILITIES
                                          and plan.group_index(str(node.role)) is not None]
    needs += [(plan.runs_on(str(node.role), generates=True), "multi-turn generate", TurnGenerator)
              for node in graph.nodes if node.environment and plan.group_index(str(node.role)) is not None]
    for policy, rollout in plan.detached_rollouts.items():
        needs += [(policy, "weight shipping", WeightSource), (rollout, "weight shipping", WeightSink)]
    for role, op, capability in needs:
        if capability.__name__ not in held.get(role, set()):
            raise TypeError(f"role {role!r} runs op {op!r}, which needs an engine with the {capability.__name__} "
                            f"capability (runtime/protocols.py), but its backend built one with "
                            f"{sorted(held.get(role, set()))}; implement {capability.__name__} or choose "
                            "another backend")
    return held
