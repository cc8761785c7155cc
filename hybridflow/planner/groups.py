"""Evaluate one colocation group: the best joint layout of its roles on a shape, memoised.

The layout policy (used for auto and manual plans alike): the roles of a group take the layouts that
minimise the group's busy time (the sum of its nodes' seconds) subject to memory per GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridflow.planner.agents import rollout_cost
from hybridflow.planner.costs import Shape, forward_cost, static_bytes, update_cost
from hybridflow.planner.fleet import fleet_routers, fleet_sync, requests_of, router_seconds
from hybridflow.planner.layouts import (
    Candidate,
    Constraint,
    GroupLayout,
    best_combination,
    engine_layout,
    role_candidates,
    smallest_combination,
    usable_bytes,
)
from hybridflow.planner.modes import OVERLAPPED, streamed_generate_seconds
from hybridflow.planner.plan import RoleLayout
from hybridflow.planner.problem import Problem, RoleWork
from hybridflow.planner.weight_moves import engine_switch, weight_load, weight_ship, weight_sync

ShapeKey = tuple[str, tuple[int, ...]]


def node_seconds(role: RoleWork, layout: RoleLayout, shape: Shape, prompt_len: int, *,
                 pipeline: str = "sync") -> dict[str, float]:
    """Seconds of each node of ``role``; the colocated engine's weight refresh and wake/sleep are charged
    to its first generate node (verl's ``gen`` timer holds them), the shipment to a detached rollout to
    the policy's last update, and in ``one_step_off`` the detached engine's loading of those weights to its
    first generate node (the pool's own work, overlapped with training). In ``async`` a detached rollout's
    generate nodes take the pool's streamed seconds (``modes.streamed_generate_seconds``); a multi-turn node
    takes its schedule's seconds (``agents.agent_cost``) in every mode."""
    resident = static_bytes(role.model, role.kind, engine_layout(layout) if role.generates_only else layout, shape)
    seconds = {load.node: streamed_generate_seconds(role.model, load, prompt_len, layout, shape, resident)[0]
               if role.streams and role.agent(load.node) is None else
               rollout_cost(role.model, load, prompt_len, layout, shape, resident, role.agent(load.node)).seconds
               for load in role.generate}
    if role.generate and role.update:
        first = role.generate[0].node
        seconds[first] += weight_sync(role.model, layout, shape)[0]
        seconds[first] += engine_switch(role.model, role.kind, layout, shape)
    if role.served:  # the fleet's broadcast and reloads in every mode, and the router on every request (fleet.py)
        seconds[role.generate[0].node] += fleet_sync(role.model, layout, shape)[0]
        for load in role.generate:
            requests = requests_of(load, role.agent(load.node))
            seconds[load.node] += router_seconds(requests, shape, fleet_routers(layout, shape))
    elif role.generates_only and pipeline in OVERLAPPED:
        seconds[role.generate[0].node] += weight_load(role.model, layout, shape)
    for load in role.forward:
        seconds[load.node] = forward_cost(role.model, role.kind, load, layout, shape).seconds
    last = len(role.update) - 1
    for index, load in enumerate(role.update):
        extra = 0.0
        if index == last and role.ships_to:
            extra += weight_ship(role.model, layout, shape)[0]
        seconds[load.node] = update_cost(role.model, role.kind, load, layout, shape).seconds + extra
    return seconds


def transient_bytes(role: RoleWork, layout: RoleLayout, shape: Shape, prompt_len: int) -> int:
    resident = static_bytes(role.model, role.kind, layout, shape)
    costs = [rollout_cost(role.model, load, prompt_len, layout, shape, resident, role.agent(load.node))
             for load in role.generate]
    costs += [forward_cost(role.model, role.kind, load, layout, shape) for load in role.forward]
    costs += [update_cost(role.model, role.kind, load, layout, shape) for load in role.update]
    return max((cost.transient_bytes for cost in costs), default=0)


class GroupEvaluator:
    """Memoised best layouts per (role set, device, GPUs per machine) for one :class:`Problem`."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.prompt_len = problem.workload.prompt_len
        self._fronts: dict[tuple[str, ShapeKey], list[Candidate]] = {}
        self._groups: dict[tuple[tuple[str, ...], ShapeKey], GroupLayout | None] = {}
        self.evaluations = 0

    def shape(self, device: str, counts: Sequence[int]) -> Shape:
        cluster = self.problem.cluster
        return Shape(cluster.device(device), tuple(sorted(counts, reverse=True)), cluster.inter_node_bandwidth,
                     run=self.problem.settings, constants=self.problem.calibration.for_device(device),
                     overlay=self.problem.overlay)

    def front(self, role: str, shape: Shape) -> list[Candidate]:
        key = (role, (shape.device.name, shape.counts))
        if key not in self._fronts:
            work = self.problem.role(role)
            self._fronts[key] = role_candidates(work, shape, shape.device.preferred_dtype, self.prompt_len,
                                                self.fixed(role), max_tp=self.problem.max_tp,
                                                support=self.problem.support_of(role))
        return self._fronts[key]

    def fixed(self, role: str) -> Constraint | None:
        """The user's fixed layout fields of ``role`` in a search (its micro batch), None when it fixed none."""
        size = self.problem.micro_batch_sizes.get(role)
        return Constraint(micro_batch_size=size) if size else None

    def best(self, roles: tuple[str, ...], shape: Shape) -> GroupLayout | None:
        """The group's best layout, or None when its roles cannot share ``shape``'s memory."""
        key = (roles, (shape.device.name, shape.counts))
        if key not in self._groups:
            self.evaluations += 1
            chosen = best_combination([self.front(role, shape) for role in roles], usable_bytes(shape))
            self._groups[key] = None if chosen is None else self.describe(tuple(c.layout for c in chosen), shape)
        return self._groups[key]

    def constrained(self, roles: tuple[str, ...], shape: Shape, constraints: Mapping[str, Constraint],
                    dtypes: Mapping[str, str]) -> tuple[GroupLayout, bool]:
        """Best layout honouring a user's fixed fields; if nothing fits, the smallest one and False."""
        fronts = [role_candidates(self.problem.role(role), shape, dtypes[role], self.prompt_len, constraints[role],
                                  max_tp=self.problem.max_tp, support=self.problem.support_of(role))
                  for role in roles]
        if any(not front for front in fronts):
            raise ValueError(f"roles {list(roles)}: no layout matches the fixed tp/sharding/micro batch on "
                             f"{shape.size} x {shape.device.name} that the roles' backends run "
                             f"({', '.join(f'{r}: {self.problem.support_of(r).backend}' for r in roles)})")
        chosen = best_combination(fronts, usable_bytes(shape))
        fits = chosen is not None
        picked = chosen if chosen is not None else smallest_combination(fronts)
        return self.describe(tuple(c.layout for c in picked), shape), fits

    def describe(self, layouts: tuple[RoleLayout, ...], shape: Shape) -> GroupLayout:
        """Node times, memory per GPU and weight-refresh bytes of a group with these layouts."""
        seconds: dict[str, float] = {}
        static, peak, sync, sync_seconds, latency = 0, 0, 0, 0.0, 0.0
        for layout in layouts:
            work = self.problem.role(layout.role)
            seconds.update(node_seconds(work, layout, shape, self.prompt_len, pipeline=self.problem.mode.pipeline))
            costed = engine_layout(layout) if work.generates_only else layout  # as _rollout_candidates counts it
            static += static_bytes(work.model, work.kind, costed, shape)
            peak = max(peak, transient_bytes(work, costed, shape, self.prompt_len))
            if work.generate and work.update:
                refresh_s, refresh = weight_sync(work.model, layout, shape)
                sync, sync_seconds = sync + refresh * shape.size, sync_seconds + refresh_s
            if work.ships_to:
                ship_s, ship = weight_ship(work.model, layout, shape)
                sync, sync_seconds = sync + ship, sync_seconds + ship_s
            if work.served:
                fan_s, fan = fleet_sync(work.model, layout, shape)
                sync, sync_seconds = sync + fan, sync_seconds + fan_s
            elif work.generates_only and self.problem.mode.pipeline in OVERLAPPED:
                sync_seconds += weight_load(work.model, layout, shape)
            if work.streams:
                resident = static_bytes(work.model, work.kind, costed, shape)
                latency += sum(streamed_generate_seconds(work.model, load, self.prompt_len, layout, shape, resident)[1]
                               for load in work.generate)
        return GroupLayout(layouts=layouts, node_seconds=tuple(seconds.items()), busy_seconds=sum(seconds.values()),
                           memory_bytes=static + peak, weight_sync_bytes=sync, weight_sync_seconds=sync_seconds,
                           batch_latency_s=latency)
