"""The auto planner: colocation partitions × GPU allocations × per-group layouts, by branch and bound.

For each partition of the roles into groups, groups take allocations one by one; a partial plan is cut
when the step's lower bound with every unplaced group at its fastest possible times already exceeds the best
plan found (``schedule.lower_bound``: valid for any order the groups take their nodes in, and monotone in node
times). Small clusters are searched GPU by
GPU, which is exact; large ones in whole machines (see ``PlannerOptions.exact_gpu_limit``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from hybridflow.planner.assemble import Placement, build_plan, group_seconds, idle_fraction
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.costs import Shape
from hybridflow.planner.errors import InfeasibleError, explain_infeasible
from hybridflow.planner.groups import GroupEvaluator
from hybridflow.planner.layouts import GroupLayout
from hybridflow.planner.lora_costs import LoraPlan
from hybridflow.planner.modes import DEFAULT_STALENESS, OVERLAPPED, explain_choice, overlap_blocker
from hybridflow.planner.plan import Plan, SearchStats, detachable_policies, rollout_role
from hybridflow.planner.problem import Problem
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.schedule import Schedule, Sharing, compile_schedule, lower_bound, shared_step
from hybridflow.planner.streamed_search import stream_choice, streamed_plan
from hybridflow.planner.support import ANY_LAYOUT
from hybridflow.planner.units import GpuUnits, MachineUnits, State, Token, Units

TOLERANCE = 1e-9  # relative: step times this close count as equal and fall to the tie-breaks
LORA_WHEN = ("always", "needed")


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Search settings. ``unit``: "auto" (GPUs up to ``exact_gpu_limit``, machines above), "gpu" or "machine".

    ``max_tp``: the most tensor parallelism a training or forward layout may use (1 when the training
    backends have none, as hybridflow's own); rollout engines are not capped.
    ``separate_rollout``: also consider giving each trainable policy's rollout GPUs of its own (its
    weights shipped there after every update, as OpenRLHF does with its vLLM engines), keeping it
    only when the modelled step is faster. It roughly doubles the search time.
    ``lora_when``: "always" (plan the request's LoRA adapters) or "needed" (keep full fine-tuning where it fits and
    plan with the adapters only when it fits nowhere; the plan says which and why); the request's
    ``shared_weights`` apply only to plans with the adapters. What is planned, and every input the user fixed
    (execution mode, layouts the backends run, micro batches, token budgets), is the :class:`PlanRequest`'s.
    """

    exact_gpu_limit: int = 16
    unit: str = "auto"
    machine_grid_ratio: float = 1.25
    max_tp: int | None = None
    separate_rollout: bool = False
    lora_when: str = "always"

    def __post_init__(self) -> None:
        if self.lora_when not in LORA_WHEN:
            raise ValueError(f"PlannerOptions.lora_when={self.lora_when!r} must be one of {list(LORA_WHEN)} (always: "
                             "plan the adapters; needed: only when full fine-tuning fits nowhere)")
        if self.unit not in ("auto", "gpu", "machine"):
            raise ValueError(f"PlannerOptions.unit={self.unit!r} must be 'auto', 'gpu' or 'machine'")
        if self.max_tp is not None and self.max_tp < 1:
            raise ValueError(f"PlannerOptions.max_tp={self.max_tp} must be >= 1 (or None: no cap)")
        if self.machine_grid_ratio <= 1:
            raise ValueError(f"PlannerOptions.machine_grid_ratio={self.machine_grid_ratio} must be > 1")

    def units(self, cluster: Cluster) -> Units:
        exact = self.unit == "gpu" or (self.unit == "auto" and cluster.num_gpus <= self.exact_gpu_limit)
        return GpuUnits(cluster) if exact else MachineUnits(cluster, self.machine_grid_ratio)


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to split ``items`` into non-empty blocks, each block in ``items`` order (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        for i in range(len(partition)):
            yield [*partition[:i], (first, *partition[i]), *partition[i + 1:]]
        yield [(first,), *partition]


Key = tuple[float, int, float, int]


@dataclass
class _Best:
    key: Key | None = None
    placements: list[Placement] | None = None


class Searcher:
    """One search over one problem; ``run`` returns the best placements found."""

    def __init__(self, problem: Problem, units: Units) -> None:
        self.problem = problem
        self.units = units
        self.evaluator = GroupEvaluator(problem)
        self.best = _Best()
        self.visited = 0
        self._options: dict[State, list[tuple[str, tuple[int, ...], Token, State]]] = {}
        self._optimistic: dict[tuple[str, ...], dict[str, float] | None] = {}

    def options(self, state: State) -> list[tuple[str, tuple[int, ...], Token, State]]:
        if state not in self._options:
            self._options[state] = list(self.units.options(state))
        return self._options[state]

    def optimistic(self, roles: tuple[str, ...]) -> dict[str, float] | None:
        """Each node's least seconds over every allocation of the whole cluster; None if none fits."""
        if roles not in self._optimistic:
            best: dict[str, float] | None = None
            for device, counts, _, _ in self.options(self.units.initial()):
                group = self.evaluator.best(roles, self.evaluator.shape(device, counts))
                if group is None:
                    continue
                seconds = dict(group.node_seconds)
                best = seconds if best is None else {n: min(t, seconds[n]) for n, t in best.items()}
            self._optimistic[roles] = best
        return self._optimistic[roles]

    def run(self, only: Sequence[tuple[str, ...]] | None = None) -> list[Placement] | None:
        """The best placements over every partition of the roles, or over the partition ``only``."""
        partitions = []
        for blocks in set_partitions(self.problem.role_names):
            if only is not None and blocks != list(only):
                continue
            if any(policy in block and rollout in block for policy, rollout in self.problem.apart for block in blocks):
                continue  # that is the colocated rollout, which the undetached problem models
            bounds = [self.optimistic(block) for block in blocks]
            if any(b is None for b in bounds):
                continue
            schedule = compile_schedule(self.problem, {r: i for i, block in enumerate(blocks) for r in block})
            seconds = self._seconds(schedule, bounds)
            partitions.append((lower_bound(schedule, seconds), blocks, schedule, seconds))
        partitions.sort(key=lambda p: p[0])
        for lower, blocks, schedule, seconds in partitions:
            if self._beaten(lower):
                continue
            # Heaviest groups first: their choice moves the bound most.
            order = sorted(range(len(blocks)), key=lambda i: -sum(self.optimistic(blocks[i]).values()))  # type: ignore[union-attr]
            self._branch(blocks, order, 0, self.units.initial(), schedule, seconds, [None] * len(blocks))
        return self.best.placements

    def _seconds(self, schedule: Schedule, bounds: Sequence[Mapping[str, float] | None]) -> list[float]:
        merged: dict[str, float] = {}
        for bound in bounds:
            merged.update(bound or {})
        return [merged.get(name, 0.0) for name in schedule.nodes]

    def _beaten(self, lower: float) -> bool:
        return self.best.key is not None and lower > self.best.key[0] * (1 + TOLERANCE)

    def _branch(self, blocks: list[tuple[str, ...]], order: list[int], depth: int, state: State, schedule: Schedule,
                seconds: list[float], chosen: list[tuple[Placement, Token] | None]) -> None:
        if depth == len(order):
            self._finish(schedule, chosen)
            return
        index = order[depth]
        roles = blocks[index]
        mine = self._indices(schedule, roles)
        saved = [seconds[i] for i in mine]
        evaluated: list[tuple[float, int, GroupLayout, Shape, Token, State]] = []
        for device, counts, token, rest in self.options(state):
            shape = self.evaluator.shape(device, counts)
            group = self.evaluator.best(roles, shape)
            if group is not None:
                evaluated.append((group.busy_seconds, len(evaluated), group, shape, token, rest))
        evaluated.sort(key=lambda e: (e[0], e[1]))
        for _, _, group, shape, token, rest in evaluated:
            self.visited += 1
            times = dict(group.node_seconds)
            for i in mine:
                seconds[i] = times[schedule.nodes[i]]
            if self._beaten(lower_bound(schedule, seconds)):
                continue
            chosen[index] = (Placement(roles, (), shape, group), token)
            self._branch(blocks, order, depth + 1, rest, schedule, seconds, chosen)
        for i, value in zip(mine, saved, strict=True):
            seconds[i] = value
        chosen[index] = None

    def _indices(self, schedule: Schedule, roles: tuple[str, ...]) -> list[int]:
        nodes = {node for role in roles for node in self.problem.role(role).nodes}
        return [i for i, name in enumerate(schedule.nodes) if name in nodes]

    def _finish(self, schedule: Schedule, chosen: list[tuple[Placement, Token] | None]) -> None:
        # The step is at least the bound the search prunes with (async's batch-latency term and shared cores only
        # add), so the bounds stay valid.
        picks = [c for c in chosen if c is not None]
        gpu_lists = self.units.realise([token for _, token in picks])
        placements = [Placement(p.roles, gpus, p.shape, p.layout) for (p, _), gpus in zip(picks, gpu_lists,
                                                                                          strict=True)]
        latency = sum(p.layout.batch_latency_s for p in placements)
        sharing = Sharing.of(self.problem.cluster, gpu_lists)
        _, step, _ = shared_step(schedule, group_seconds(schedule, placements), latency, sharing)
        key = (step, schedule.cross_group_bytes, round(idle_fraction(step, placements), 9),
               sum(len(p.gpus) for p in placements))
        if self.best.key is None or _better(key, self.best.key):
            self.best = _Best(key, placements)


def _better(new: Key, old: Key) -> bool:
    if new[0] < old[0] * (1 - TOLERANCE):
        return True
    if new[0] > old[0] * (1 + TOLERANCE):
        return False
    return new[1:] < old[1:]


def plan_placement(request: PlanRequest, options: PlannerOptions | None = None) -> Plan:
    """The plan with the least modelled step time (ties: fewer cross-group bytes, then less idle time).

    ``request``: what is planned and every input the user fixed (:class:`PlanRequest`); ``options``: how the
    search runs. With ``request.pipeline`` "auto" the plan records the mode compared fastest and why
    (``extra["pipeline_choice"]``); with ``request.agent`` the faster agent schedule in ``mode.agent_schedule``
    and why in ``extra["agent_schedule"]``. With ``request.stream_chunks`` > 1 (a sync step) the search also costs
    streamed steps and keeps the faster, saying which and why in ``extra["stream_choice"]`` (:mod:`.streamed_search`).

    With ``request.lora`` the trainable roles train adapters (``options.lora_when="needed"``: only when full
    fine-tuning fits nowhere); ``extra["lora"]`` gives their trainable weights, gradient and optimizer memory and
    sync bytes.

    Raises :class:`InfeasibleError` naming what does not fit, and by how much, when no plan fits.
    """
    if not isinstance(request, PlanRequest):
        raise TypeError(f"plan_placement takes a PlanRequest, got {type(request).__name__}; build one: "
                        "plan_placement(PlanRequest(graph, models, workload, cluster, ...), options)")
    opts = options or PlannerOptions()
    adapters = request.adapters()
    if not adapters or opts.lora_when == "always":
        return _plan(request, opts, adapters=adapters, shared=request.shared_weights)
    try:
        full = _plan(request, opts, adapters={}, shared={})
    except InfeasibleError as err:
        reason = str(err).removeprefix("no placement fits: ")
        try:
            plan = _plan(request, opts, adapters=adapters, shared=request.shared_weights)
        except InfeasibleError as lora_err:
            raise InfeasibleError(f"full fine-tuning fits nowhere ({reason}); with LoRA neither: {lora_err}") from err
        why = f"full fine-tuning fits nowhere ({reason}): planned with LoRA; {dict(plan.extra)['lora']}"
        return _with_extra(plan, "lora", why)
    return _with_extra(full, "lora", "full fine-tuning fits: LoRA, allowed when needed, is not used")


def _with_extra(plan: Plan, key: str, value: str) -> Plan:
    return replace(plan, extra=tuple(sorted({**dict(plan.extra), key: value}.items())))


def _plan(request: PlanRequest, opts: PlannerOptions, *, adapters: Mapping[str, LoraPlan],
          shared: Mapping[str, str]) -> Plan:
    """The search over every mode the request asks for, with these adapters and shared weights."""
    start = time.perf_counter()
    found: list[tuple[Problem, Searcher, list[Placement]]] = []
    visited = 0
    fallback: tuple[Problem, Searcher] | None = None
    cluster = request.cluster
    for detach, pipeline, bound in _modes(request, opts):
        problem = request.problem(detach=detach, pipeline=pipeline, max_staleness=bound, adapters=adapters,
                                  shared_weights=shared, max_tp=opts.max_tp)
        searcher = Searcher(problem, opts.units(cluster))
        placements = searcher.run()
        visited += searcher.visited + searcher.evaluator.evaluations
        fallback = fallback or (problem, searcher)
        if placements is not None:
            found.append((problem, searcher, placements))
    if not found:
        assert fallback is not None
        if served(request) and cluster.num_gpus < 2:
            raise InfeasibleError("a policy's rollout is served (rollout: server): its fleet needs GPUs of its own, "
                                  f"at least 2 GPUs in all, the cluster has {cluster.num_gpus}; add GPUs or use "
                                  "rollout: vllm to generate on the trainer's GPUs")
        if request.pipeline in OVERLAPPED and cluster.num_gpus < 2:
            raise InfeasibleError(f"PlanRequest.pipeline={request.pipeline!r} needs the rollout on GPUs of its own: "
                                  f"at least 2 GPUs, the cluster has {cluster.num_gpus}; use pipeline='sync'")
        problem, searcher = fallback
        raise InfeasibleError(explain_infeasible(problem, searcher.evaluator))
    stats = SearchStats(method=found[0][1].units.name, candidates=visited,
                        seconds=round(time.perf_counter() - start, 4))
    plans = [_assemble(problem, placements, stats) for problem, _, placements in found]
    best = 0
    for index, plan in enumerate(plans):  # a tie keeps the earlier, simpler mode
        if plan.step_time_s < plans[best].step_time_s * (1 - TOLERANCE):
            best = index
    chosen = plans[best]
    if len(plans) > 1 or request.pipeline != "sync":
        why = explain_choice(chosen, [plan for i, plan in enumerate(plans) if i != best])
        chosen = replace(chosen, extra=tuple(sorted((*chosen.extra, ("pipeline_choice", why)))))
    if request.stream_chunks > 1:
        chosen = _streamed_or_not(request if adapters else replace(request, lora=None, shared_weights={}),
                                  chosen, [(problem, searcher) for problem, searcher, _ in found])
    return chosen


def _streamed_or_not(request: PlanRequest, chosen: Plan, searched: Sequence[tuple[Problem, Searcher]]) -> Plan:
    """``chosen`` or, where faster, the best streamed candidate (:mod:`.streamed_search`), saying which and why."""
    generate = request.graph.stream_generate
    if generate is None:
        raise ValueError(f"PlanRequest.stream_chunks={request.stream_chunks}: the {request.graph.name} graph has no "
                         "single sampling generate node fed by the step's inputs whose other generates answer its "
                         "rows one by one (or it has a filter), so there is nothing to stream: use stream_chunks=1")
    streamed = []
    for problem, searcher in searched:
        for blocks in set_partitions(problem.role_names):
            if any(policy in block and rollout in block for policy, rollout in problem.apart for block in blocks):
                continue
            searcher.best = _Best()
            placements = searcher.run(only=blocks)
            plan = streamed_plan(request, placements) if placements is not None else None
            if plan is not None:
                streamed.append(plan)
    fastest = min(streamed, key=lambda plan: plan.step_time_s, default=None)
    pick = fastest if fastest is not None and fastest.step_time_s < chosen.step_time_s * (1 - TOLERANCE) else chosen
    if pick is not chosen:
        extra = {**dict(pick.extra), **dict(chosen.extra)}
        pick = replace(pick, search=chosen.search, extra=tuple(sorted(extra.items())))
    return _with_extra(pick, "stream_choice", stream_choice(pick, chosen, streamed, generate.name))


Mode = tuple[tuple[str, ...], str, int | None]  # (detached policies, pipeline, max_staleness)


def _modes(request: PlanRequest, options: PlannerOptions) -> list[Mode]:
    """The (detached policies, pipeline, staleness) problems to search, simplest first."""
    graph, pipeline = request.graph, request.pipeline
    detachable = detachable_policies(graph)
    bounds = (request.max_staleness,) if request.max_staleness is not None else DEFAULT_STALENESS
    overlapped: list[Mode] = [(detachable, "one_step_off", None)] + [(detachable, "async", k) for k in bounds]
    if pipeline in OVERLAPPED:
        blocker = overlap_blocker(graph, pipeline)
        if blocker is not None:
            raise ValueError(f"PlanRequest.pipeline={pipeline!r}: {blocker}; use pipeline='sync'")
        return [mode for mode in overlapped if mode[1] == pipeline]
    modes: list[Mode] = [((), "sync", None)]
    if detachable and (options.separate_rollout or pipeline == "auto" or served(request)):
        modes.append((detachable, "sync", None))
    if detachable and pipeline == "auto" and overlap_blocker(graph) is None:
        modes.extend(overlapped)
    # A served rollout's fleet never shares the trainer's GPUs (fleet.py): its colocated mode is not searched.
    return [mode for mode in modes if mode[0] or not served(request)]


def served(request: PlanRequest) -> bool:
    """Whether a policy of the request generates through server replicas (its rollout's support is ``served``)."""
    return any(request.support.get(rollout_role(policy), request.support.get(policy, ANY_LAYOUT)).served
               for policy in detachable_policies(request.graph))


def _assemble(problem: Problem, placements: list[Placement], stats: SearchStats) -> Plan:
    # Groups in the order of their roles in the graph, so equal inputs print equal plans.
    rank = {role: i for i, role in enumerate(problem.role_names)}
    return build_plan(problem, sorted(placements, key=lambda p: rank[p.roles[0]]), search=stats)


def solve(problem: Problem, units: Units) -> list[Placement] | None:
    """The search's placements for an already-built problem (used by tests and benchmarks)."""
    return Searcher(problem, units).run()
