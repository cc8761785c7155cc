"""Turn a placement (role groups, their GPUs and layouts) into a :class:`Plan` with the model's estimates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hybridflow.planner.agents import choose_schedule, explain_schedule, schedule_seconds
from hybridflow.planner.costs import Shape, batching, state_bytes, static_bytes, vision_seconds
from hybridflow.planner.devices import DTYPE_BYTES, GIB
from hybridflow.planner.errors import gib
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.fleet import (
    FLEET_KEY,
    fleet_replicas,
    fleet_routers,
    fleet_sync,
    requests_of,
    router_seconds,
)
from hybridflow.planner.layouts import GroupLayout, engine_layout
from hybridflow.planner.plan import GroupPlan, NodeEstimate, Plan, RoleLayout, SearchStats
from hybridflow.planner.problem import Problem, RoleWork
from hybridflow.planner.rollout import vision_prefill_seconds
from hybridflow.planner.schedule import DRIVER, Schedule, Sharing, compile_schedule, shared_step, stream_schedule
from hybridflow.planner.step_terms import step_terms
from hybridflow.planner.weight_moves import adapter_only, weight_ship, weight_sync


@dataclass(frozen=True)
class Placement:
    """One group of a plan before it becomes a :class:`GroupPlan`."""

    roles: tuple[str, ...]
    gpus: tuple[int, ...]
    shape: Shape
    layout: GroupLayout


def group_seconds(schedule: Schedule, groups: Sequence[Placement]) -> list[float]:
    """Per scheduled node, its seconds on its group (0 for driver nodes, which the schedule times)."""
    by_node: dict[str, float] = {}
    for group in groups:
        by_node.update(group.layout.node_seconds)
    return [by_node.get(name, 0.0) if g != DRIVER else 0.0 for name, g in zip(schedule.nodes, schedule.group_of,
                                                                               strict=True)]


def idle_fraction(step: float, groups: Sequence[Placement]) -> float:
    """Share of the used GPU-seconds a step leaves idle: the balance tie-break (lower is better)."""
    used = sum(len(g.gpus) for g in groups)
    if step <= 0 or used == 0:
        return 0.0
    return 1.0 - sum(g.layout.busy_seconds * len(g.gpus) for g in groups) / (step * used)


def build_plan(problem: Problem, groups: Sequence[Placement], *, search: SearchStats | None = None,
               problems: Sequence[str] = (), streamed: tuple[int, Sequence[Placement]] | None = None) -> Plan:
    """The plan for ``groups`` with node timings, totals and the bottleneck the schedule shows.

    ``streamed``: a sync step streamed in that many chunks, with the same groups costed on one chunk's rows
    (``schedule.stream_schedule``); a streamed node's estimate spans its first chunk's start to its last's end
    (``start_s``, ``end_s``), and its seconds are its chunks' own, summed: the time it runs, not the time it waits
    between chunks, as a run's ``time/<node>`` sums its calls.
    """
    role_group = {role: index for index, group in enumerate(groups) for role in group.roles}
    schedule = compile_schedule(problem, role_group)
    latency = sum(group.layout.batch_latency_s for group in groups)
    sharing = Sharing.of(problem.cluster, [group.gpus for group in groups])
    seconds = group_seconds(schedule, groups)
    extra: dict[str, float | str] = {}
    if streamed is None:
        spans, span, latency = shared_step(schedule, seconds, latency, sharing)
        busy = [end - start for start, end in spans]
    else:
        chunks, chunk_groups = streamed
        generate = problem.graph.stream_generate
        assert generate is not None and problem.mode.stream_chunks == chunks, "streaming a problem of other chunks"
        expanded, origin = stream_schedule(schedule, generate.name, problem.graph.streamed_followers, chunks)
        per_chunk = group_seconds(schedule, chunk_groups)
        pieces, span, _ = shared_step(expanded, [per_chunk[i] if chunk >= 0 else seconds[i] for i, chunk in origin],
                                      0.0, sharing)
        spans = [(min(a for (j, _), (a, _) in zip(origin, pieces, strict=True) if j == i),
                  max(b for (j, _), (_, b) in zip(origin, pieces, strict=True) if j == i))
                 for i in range(len(schedule.nodes))]
        busy = [sum(b - a for (j, _), (a, b) in zip(origin, pieces, strict=True) if j == i)
                for i in range(len(schedule.nodes))]
    terms = step_terms(problem, groups)
    step = span + sum(terms.values())
    if any(terms.values()):
        extra["step_terms_s"] = sum(terms.values())
        extra["step_terms"] = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in terms.items() if seconds)
    extra["idle_fraction"] = round(idle_fraction(step, groups), 6)
    if problem.mode.pipeline == "async":
        extra["batch_latency_s"] = latency  # what modes.describe_mode explains the async step with
    nodes = tuple(
        NodeEstimate(node=name, group=None if g == DRIVER else g, seconds=own, start_s=start, end_s=end,
                     role=problem.node_role[name])
        for name, g, (start, end), own in zip(schedule.nodes, schedule.group_of, spans, busy, strict=True))
    mode = problem.mode
    if problem.agents:
        mode, why = agent_schedule(problem, groups)
        extra["agent_schedule"] = why
    if any(role.model.adapter is not None for role in problem.roles):
        extra["lora"] = adapter_summary(problem, groups)
    extra.update(fleet_extra(problem, groups))
    if problem.workload.image_tokens and any(role.model.vision is not None for role in problem.roles):
        extra["vision_s"], extra["vision_share"], extra["vision"] = vision_summary(problem, groups)
    cluster = problem.cluster
    plans = []
    for group in groups:
        guests = tuple(replace(layout, role=guest, shares_weights_with=layout.role) for layout in group.layout.layouts
                       for guest in problem.role(layout.role).guests)
        plans.append(GroupPlan(gpus=group.gpus, hosts=tuple(cluster.machines[cluster.machine_index(g)].host
                                                            for g in group.gpus),
                               device=group.shape.device.name, roles=group.roles + tuple(g.role for g in guests),
                               layouts=group.layout.layouts + guests, memory_per_gpu_bytes=group.layout.memory_bytes,
                               capacity_bytes=group.shape.device.memory_bytes))
    return Plan(algorithm=problem.graph.name, groups=tuple(plans), driver_roles=problem.driver_roles, nodes=nodes,
                step_time_s=step, cross_group_bytes=schedule.cross_group_bytes,
                weight_sync_bytes=sum(group.layout.weight_sync_bytes for group in groups),
                weight_sync_seconds=sum(group.layout.weight_sync_seconds for group in groups),
                bottleneck=bottleneck(nodes, groups, step), feasible=not problems, problems=tuple(problems),
                search=search, extra=tuple(sorted(extra.items())), mode=mode)


def fleet_extra(problem: Problem, groups: Sequence[Placement]) -> dict[str, float]:
    """``fleet/<role>/<field>`` of each served rollout (:func:`hybridflow.planner.fleet.fleets` reads them back):
    its replicas and their tensor parallelism, its group, one update's broadcast and the router's seconds."""
    extra: dict[str, float] = {}
    for index, group in enumerate(groups):
        for layout in group.layout.layouts:
            work = problem.role(layout.role)
            if not work.served:
                continue
            sync_s, sync = fleet_sync(work.model, layout, group.shape)
            requests = sum(requests_of(load, work.agent(load.node)) for load in work.generate)
            routers = fleet_routers(layout, group.shape)
            values = {"replicas": fleet_replicas(layout), "tp": layout.rollout_tp, "group": index,
                      "sync_bytes": sync, "sync_s": sync_s, "requests": requests, "routers": routers,
                      "router_s": sum(router_seconds(requests_of(load, work.agent(load.node)), group.shape, routers)
                                      for load in work.generate)}
            extra.update({f"{FLEET_KEY}/{work.name}/{name}": value for name, value in values.items()})
    return extra


def adapter_summary(problem: Problem, groups: Sequence[Placement]) -> str:
    """Per LoRA role: trainable weights, gradient and optimizer bytes per GPU beside full fine-tuning's on the same
    layout, and what one update sends its rollout engine; the roles that run on its weights."""
    lines = []
    for group in groups:
        for layout in group.layout.layouts:
            work = problem.role(layout.role)
            model = work.model
            if model.adapter is None or not work.kind.trainable:
                continue
            _, grads, states = state_bytes(model, work.kind, layout, group.shape)
            _, full_grads, full_states = state_bytes(model.base, work.kind, layout, group.shape)
            text = (f"{work.name}: {model.adapter.describe()} trains {model.adapter_params / 1e6:.1f}M of "
                    f"{model.params / 1e9:.2f}B weights ({model.adapter_params / model.params:.2%}); per GPU "
                    f"gradients {_size(grads)} + optimizer states {_size(states)} (full fine-tuning: "
                    f"{_size(full_grads)} + {_size(full_states)})")
            text += f"; {_sync_words(work, layout, group.shape)}"
            if work.guests:
                text += (f"; {', '.join(work.guests)} run(s) on its engine with the adapter disabled (no weights of "
                         "their own)")
            lines.append(text)
    return "; ".join(lines)


def vision_summary(problem: Problem, groups: Sequence[Placement]) -> tuple[float, float, str]:
    """(seconds, share, words): the vision towers' seconds in a step's GPU nodes on their placed layouts (rollout
    encodes, forward passes, updates), their share of those nodes' seconds, and both per node."""
    tower: dict[str, float] = {}
    total = 0.0
    for group in groups:
        shape, seconds = group.shape, dict(group.layout.node_seconds)
        total += sum(seconds.values())
        for layout in group.layout.layouts:
            work = problem.role(layout.role)
            if work.model.vision is None:
                continue
            engines = max(1, shape.size // layout.rollout_tp)
            for load in work.generate:
                tower[load.node] = vision_prefill_seconds(work.model, load, engines, layout, shape)
            for load in work.forward:
                tower[load.node] = vision_seconds(work.model, load, batching(load, layout, shape, train=False), layout,
                                                  shape, 1)
            for load in work.update:
                passes = 4 if layout.gradient_checkpointing else 3
                tower[load.node] = vision_seconds(work.model, load, batching(load, layout, shape, train=True), layout,
                                                  shape, passes)
    spent = sum(tower.values())
    share = spent / total if total else 0.0
    image = problem.workload.image_tokens
    words = (f"{spent:.3g} s of the {total:.3g} s its GPU nodes run ({share:.1%}), {image} visual tokens beside "
             f"{problem.workload.prompt_len} text tokens a prompt: "
             + ", ".join(f"{node} {value:.3g} s" for node, value in tower.items() if value))
    return spent, share, words


def _size(nbytes: float) -> str:
    return gib(nbytes) if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _sync_words(work: RoleWork, layout: RoleLayout, shape: Shape) -> str:
    """What one update sends the rollout engine, in words."""
    if work.ships_to:
        sent = weight_ship(work.model, layout, shape)[1]
    elif work.generate:
        sent = weight_sync(work.model, layout, shape)[1] * shape.size
        if not sent:
            return "rollout engine reads the trained weights in place (nothing synced per update)"
    else:
        return "no rollout engine to sync"
    if adapter_only(work.model):
        copy = work.model.adapter_params * DTYPE_BYTES[layout.dtype]
        where = "shipped to the rollout" if work.ships_to else "into the group's engines"
        return (f"sync per update: {sent / 1e6:.1f} MB {where}, adapter-only ({copy / 1e6:.1f} MB a copy; the base "
                "loaded once)")
    return f"sync per update: {sent / 1e6:.1f} MB, merged full weights (the engine takes no adapter)"


def agent_schedule(problem: Problem, groups: Sequence[Placement]) -> tuple[ExecutionMode, str]:
    """The problem's mode with the schedule its multi-turn nodes run (a node's own ``agent_schedule``, else
    the faster over all of them on their placed layouts), and both schedules' seconds in words."""
    costed = []
    for agent in problem.agents:
        role = problem.node_role[agent.node]
        group = next(g for g in groups if role in g.roles)
        work = problem.role(str(role))
        layout = next(lay for lay in group.layout.layouts if lay.role == role)
        resident = static_bytes(work.model, work.kind, engine_layout(layout) if work.generates_only else layout,
                                group.shape)
        load = next(load for load in work.generate if load.node == agent.node)
        costed.append((agent, schedule_seconds(work.model, load, problem.workload.prompt_len, layout, group.shape,
                                               agent, resident)))
    fixed = {agent.schedule for agent in problem.agents if agent.schedule}
    if len(fixed) == 1:
        chosen = fixed.pop()
    else:
        chosen = choose_schedule({name: sum(seconds[name] for _, seconds in costed) for name in ("turn", "trajectory")})
    return replace(problem.mode, agent_schedule=chosen), explain_schedule(costed, chosen)


def bottleneck(nodes: Sequence[NodeEstimate], groups: Sequence[Placement], step: float) -> str:
    """The busiest group and its longest node, in words."""
    if not groups:
        return ""
    index = max(range(len(groups)), key=lambda i: groups[i].layout.busy_seconds)
    group = groups[index]
    mine = [n for n in nodes if n.group == index]
    longest = max(mine, key=lambda n: n.seconds) if mine else None
    share = group.layout.busy_seconds / step if step else 0.0
    what = f"; longest node {longest.node} ({longest.seconds:.3g} s)" if longest else ""
    return (f"group {index} ({', '.join(group.roles)} on {len(group.gpus)}x{group.shape.device.name}) busy "
            f"{share:.0%} of the step{what}")
