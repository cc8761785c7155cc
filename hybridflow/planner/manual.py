"""Hand-written mappings: parse them, check them, and cost them with the planner's own model.

A mapping gives each GPU role a list of GPU ids, verl-style (``actor=0-3,critic=0-3,reward=4-5``).
Roles listing the same GPUs share a group; lists that overlap only partly are rejected. A policy's
rollout may get GPUs of its own (``actor:rollout=4-5``, OpenRLHF-style); the same GPUs as the policy
mean the usual colocated rollout.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hybridflow.planner.assemble import Placement, build_plan
from hybridflow.planner.cluster import MAX_CLUSTER_GPUS
from hybridflow.planner.devices import DeviceSpec
from hybridflow.planner.errors import gib
from hybridflow.planner.groups import GroupEvaluator
from hybridflow.planner.layouts import Constraint, usable_bytes
from hybridflow.planner.modes import DEFAULT_STALENESS, explain_choice, overlap_blocker
from hybridflow.planner.plan import ROLLOUT_SUFFIX, Plan, SearchStats, Sharding
from hybridflow.planner.problem import Problem
from hybridflow.planner.request import PlanRequest

PerRole = int | Mapping[str, int] | None
RoleSharding = Sharding | str | Mapping[str, Sharding | str] | None  # one for every role, or per role


def parse_mapping(text: str) -> dict[str, tuple[int, ...]]:
    """``"actor=0-3,critic=0-3,reward=4-5+7"`` -> role -> GPU ids (ranges inclusive, ``+`` joins parts)."""
    mapping: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        role, sep, gpus = item.partition("=")
        role = role.strip()
        if not sep or not role or not gpus.strip():
            raise ValueError(f"mapping item {item!r} must look like ROLE=FIRST-LAST (e.g. actor=0-3)")
        if role in mapping:
            raise ValueError(f"mapping lists role {role!r} twice; give each role one GPU list")
        ids: list[int] = []
        for part in gpus.split("+"):
            first, _, last = part.strip().partition("-")
            try:
                low, high = int(first), int(last or first)
            except ValueError as err:
                raise ValueError(f"mapping item {item!r}: {part.strip()!r} is not a GPU id or range like 0-3") from err
            if low < 0 or high < low:
                raise ValueError(f"mapping item {item!r}: range {part.strip()!r} must be FIRST-LAST with 0 <= FIRST "
                                 "<= LAST")
            if high >= MAX_CLUSTER_GPUS:
                raise ValueError(f"mapping item {item!r}: GPU id {high} is beyond the planner's bound of "
                                 f"{MAX_CLUSTER_GPUS} GPUs; give ids of the cluster's GPUs (0 to its size - 1)")
            ids.extend(range(low, high + 1))
        mapping[role] = tuple(ids)
    if not mapping:
        raise ValueError(f"mapping {text!r} is empty; write e.g. actor=0-3,critic=0-3,reward=4-5,reference=4-5")
    return mapping


Groups = list[tuple[tuple[str, ...], tuple[int, ...]]]


def group_roles(problem: Problem, mapping: Mapping[str, Sequence[int]]) -> Groups:
    """Check ``mapping`` against the problem and merge roles with the same GPU list into groups."""
    cluster, roles = problem.cluster, problem.role_names
    for role in mapping:
        if role in problem.driver_roles:
            raise ValueError(f"role {role!r} is a reward function and runs on the driver; drop it from the mapping")
        if role not in roles:
            raise ValueError(f"mapping names role {role!r}, which graph {problem.graph.name!r} lacks; GPU roles: "
                             f"{list(roles)}")
    missing = [role for role in roles if role not in mapping]
    if missing:
        raise ValueError(f"mapping leaves roles {missing} without GPUs; every GPU role needs a list")
    groups: dict[tuple[int, ...], list[str]] = {}
    for role in roles:
        gpus = tuple(sorted(mapping[role]))
        if not gpus:
            raise ValueError(f"role {role!r} is mapped to no GPU")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"role {role!r} lists a GPU twice: {list(mapping[role])}")
        for gpu in gpus:
            if not 0 <= gpu < cluster.num_gpus:
                raise ValueError(f"role {role!r} is mapped to GPU {gpu}, which does not exist; the cluster has GPUs "
                                 f"0-{cluster.num_gpus - 1}")
        devices = {cluster.machine_of(gpu).device.name for gpu in gpus}
        if len(devices) > 1:
            raise ValueError(f"role {role!r} spans device types {sorted(devices)}; a group must be one type "
                             "(the slow type would pace the fast one); split it")
        groups.setdefault(gpus, []).append(role)
    keys = list(groups)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            shared = sorted(set(a) & set(b))
            if shared:
                raise ValueError(f"roles {groups[a]} (GPUs {list(a)}) and {groups[b]} (GPUs {list(b)}) share GPUs "
                                 f"{shared} but not all; colocated roles must list exactly the same GPUs")
    return [(tuple(members), gpus) for gpus, members in groups.items()]


def _per_role(value: PerRole, role: str, what: str) -> int | None:
    if value is None:
        return None
    number = value.get(role) if isinstance(value, Mapping) else value
    if number is not None and (not isinstance(number, int) or number < 1):
        raise ValueError(f"{what} for role {role!r} is {number!r}; it must be a positive integer")
    return number


def _constraint(role: str, size: int, data_parallel_size: PerRole, sharding: RoleSharding,
                micro_batch_sizes: PerRole, rollout_tp: PerRole = None,
                splits: Mapping[str, PerRole] | None = None, checkpointing: bool | None = None) -> Constraint:
    dp = _per_role(data_parallel_size, role, "data_parallel_size")
    rtp = _per_role(rollout_tp, role, "rollout_tp")
    if role.endswith(ROLLOUT_SUFFIX):  # a detached rollout: its data-parallel size is the engines'
        if dp is not None and size % dp:
            raise ValueError(f"data_parallel_size={dp} does not divide rollout {role!r}'s {size} GPUs")
        rtp = rtp or (size // dp if dp else None)
        dp = None
    if rtp is not None and size % rtp:
        raise ValueError(f"rollout tensor parallel size {rtp} does not divide role {role!r}'s {size} GPUs")
    if dp is not None and size % dp:
        raise ValueError(f"data_parallel_size={dp} does not divide role {role!r}'s {size} GPUs; "
                         "tensor parallel size = GPUs / data_parallel_size must be whole")
    parts = {name: _per_role(value, role, name) or 1 for name, value in (splits or {}).items() if name != "fsdp_size"}
    if dp is not None and dp % (parts.get("sequence_parallel", 1) * parts.get("pipeline_parallel", 1)):
        raise ValueError(f"role {role!r}: sequence_parallel x pipeline_parallel must divide data_parallel_size={dp}")
    chosen = sharding.get(role) if isinstance(sharding, Mapping) else sharding
    return Constraint(tp=size // dp if dp else None, sharding=Sharding(chosen) if chosen else None,
                      micro_batch_size=_per_role(micro_batch_sizes, role, "micro_batch_sizes"), rollout_tp=rtp,
                      sp=parts.get("sequence_parallel", 1), pp=parts.get("pipeline_parallel", 1),
                      ep=parts.get("expert_parallel", 1), shard_size=_per_role((splits or {}).get("fsdp_size"), role,
                                                                               "fsdp_size") or 0,
                      gradient_checkpointing=checkpointing)


def evaluate_mapping(request: PlanRequest, mapping: Mapping[str, Sequence[int]], *,
                     data_parallel_size: PerRole = None, sharding: RoleSharding = Sharding.FULL_SHARD,
                     dtypes: Mapping[str, str] | None = None, rollout_tp: PerRole = None,
                     sequence_parallel: PerRole = None, pipeline_parallel: PerRole = None,
                     expert_parallel: PerRole = None, fsdp_size: PerRole = None,
                     gradient_checkpointing: bool | None = None) -> Plan:
    """Cost a hand-written mapping of ``request`` with the planner's model; fields left None are chosen by the
    planner (``sharding``: one strategy for every role, or one per role as a mapping).

    The keywords fix the mapping's layouts: training layouts use ``data_parallel_size``; ``rollout_tp`` fixes
    the tensor-parallel size of a policy's rollout engine (verl's ``rollout.tensor_model_parallel_size``); a
    published Megatron or Ulysses run gives ``sequence_parallel``, ``pipeline_parallel`` and ``expert_parallel``
    (each splits the data-parallel ranks), ``fsdp_size`` the shard group of HYBRID_SHARD, and
    ``gradient_checkpointing`` fixes recomputation (None: the planner chooses). A fixed field outside what the
    role's backend runs (``request.support``) is a ValueError naming the role and backend.

    ``request.pipeline`` is the execution mode costed: "one_step_off" and "async" need the policy's rollout on
    GPUs of its own (else a ValueError names the fix); "auto" costs the fastest mode the mapping can run (async
    with k = 1 and 2 unless ``max_staleness`` is given; a tie keeps the simpler). ``request.lora`` adapters are
    always planned; a role that shares another's weights (``request.shared_weights``) runs on that role's GPUs:
    the mapping may omit it or give it the same GPUs.

    The plan is executable like an auto plan. A group that does not fit memory makes the plan
    infeasible, with a problem naming the group and the overflow (an OOM risk), instead of raising.
    """
    if not isinstance(request, PlanRequest):
        raise TypeError(f"evaluate_mapping takes a PlanRequest, got {type(request).__name__}; build one: "
                        "evaluate_mapping(PlanRequest(graph, models, workload, cluster, ...), mapping, ...)")
    start = time.perf_counter()
    mapping = dict(mapping)
    adapters, shared = request.adapters(), dict(request.shared_weights)
    for guest, host in shared.items():
        if guest in mapping and sorted(mapping[guest]) != sorted(mapping.get(host, ())):
            raise ValueError(f"mapping gives {guest!r} GPUs {list(mapping[guest])}, but it runs on {host!r}'s weights "
                             f"(shared_weights): give it {host!r}'s GPUs or leave it out")
        mapping.pop(guest, None)
    for role in [r for r in mapping if r.endswith(ROLLOUT_SUFFIX)]:
        if sorted(mapping[role]) == sorted(mapping.get(role.removesuffix(ROLLOUT_SUFFIX), ())):
            del mapping[role]  # the policy's own GPUs: the colocated rollout
    detach = [role.removesuffix(ROLLOUT_SUFFIX) for role in mapping if role.endswith(ROLLOUT_SUFFIX)]
    pipeline, max_staleness, stream_chunks = request.pipeline, request.max_staleness, request.stream_chunks
    modes: list[tuple[str, int | None]] = [(pipeline, max_staleness)]
    if pipeline == "auto":
        bounds = DEFAULT_STALENESS if max_staleness is None else (max_staleness,)
        overlaps = bool(detach) and overlap_blocker(request.graph) is None
        modes = [("sync", None)] + ([("one_step_off", None)] + [("async", k) for k in bounds] if overlaps else [])
    splits = {"sequence_parallel": sequence_parallel, "pipeline_parallel": pipeline_parallel,
              "expert_parallel": expert_parallel, "fsdp_size": fsdp_size}
    fixed = _Fixed(data_parallel_size, sharding, dict(request.micro_batch_sizes) or None, rollout_tp, splits,
                   gradient_checkpointing, dtypes)
    plans = []
    for mode, bound in modes:
        problem = request.problem(detach=detach, pipeline=mode, max_staleness=bound, adapters=adapters,
                                  shared_weights=shared, streamed=True)
        placements, problems = _place(problem, mapping, fixed)
        stats = SearchStats(method="manual", candidates=len(placements), seconds=round(time.perf_counter() - start, 4))
        streamed = None
        if stream_chunks > 1:
            workload = request.workload
            chunk = replace(workload, batch_size=-(-workload.batch_size // stream_chunks))
            chunk_problem = request.problem(detach=detach, pipeline=mode, max_staleness=bound, adapters=adapters,
                                            shared_weights=shared, streamed=True, workload=chunk)
            streamed = (stream_chunks, _place(chunk_problem, mapping, _pinned(fixed, placements))[0])
        plans.append(build_plan(problem, placements, search=stats, problems=problems, streamed=streamed))
    if pipeline != "auto":
        return plans[0]
    best = min(range(len(plans)), key=lambda i: (plans[i].step_time_s, i))
    why = explain_choice(plans[best], [plan for i, plan in enumerate(plans) if i != best])
    return replace(plans[best], extra=tuple(sorted((*plans[best].extra, ("pipeline_choice", why)))))


@dataclass(frozen=True)
class _Fixed:
    """The fields a user fixed for a manual mapping (None: the planner's layout policy chooses)."""

    data_parallel_size: PerRole
    sharding: RoleSharding
    micro_batch_sizes: PerRole
    rollout_tp: PerRole
    splits: Mapping[str, PerRole]
    gradient_checkpointing: bool | None
    dtypes: Mapping[str, str] | None


def _pinned(fixed: _Fixed, placements: Sequence[Placement]) -> _Fixed:
    """``fixed`` with every role's parallel sizes and dtype as ``placements`` chose them (a streamed chunk runs
    on the same engines and shards; only its rows, so its micro batches, differ)."""
    layouts = [layout for placement in placements for layout in placement.layout.layouts]
    trained = {lay.role: lay.dp for lay in layouts if not lay.role.endswith(ROLLOUT_SUFFIX)}
    return replace(fixed, data_parallel_size=trained, rollout_tp={lay.role: lay.rollout_tp for lay in layouts},
                   dtypes={lay.role: lay.dtype for lay in layouts})


def _place(problem: Problem, mapping: Mapping[str, Sequence[int]], fixed: _Fixed) -> tuple[list[Placement], list[str]]:
    """Each mapped group with the best layout honouring ``fixed``; an overflow is a problem, not an error."""
    cluster = problem.cluster
    evaluator = GroupEvaluator(problem)
    placements, problems = [], []
    for roles, gpus in group_roles(problem, mapping):
        counts: dict[int, int] = {}
        for gpu in gpus:
            counts[cluster.machine_index(gpu)] = counts.get(cluster.machine_index(gpu), 0) + 1
        device = cluster.machine_of(gpus[0]).device
        shape = evaluator.shape(device.name, list(counts.values()))
        constraints = {role: _constraint(role, len(gpus), fixed.data_parallel_size, fixed.sharding,
                                         fixed.micro_batch_sizes, fixed.rollout_tp, fixed.splits,
                                         fixed.gradient_checkpointing) for role in roles}
        for role, constraint in constraints.items():
            if constraint.tp and not shape.tp_allowed(constraint.tp):
                raise ValueError(f"role {role!r}: tensor parallel size {constraint.tp} would split across machines "
                                 f"(GPUs per machine {list(shape.counts)}); change data_parallel_size")
        chosen = _dtypes(roles, device, fixed.dtypes)
        layout, fits = evaluator.constrained(roles, shape, constraints, chosen)
        if not fits:
            problems.append(f"OOM risk: group {list(roles)} on GPUs {_ranges(gpus)} ({device.name}) needs "
                            f"{gib(layout.memory_bytes)} per GPU, {gib(usable_bytes(shape))} usable: over by "
                            f"{gib(layout.memory_bytes - usable_bytes(shape))}")
        placements.append(Placement(roles, gpus, shape, layout))
    return placements, problems


def _dtypes(roles: Sequence[str], device: DeviceSpec, given: Mapping[str, str] | None) -> dict[str, str]:
    """Each role's dtype: the one given, else the device's best; one the device lacks is an error."""
    chosen = {role: (given or {}).get(role, device.preferred_dtype) for role in roles}
    for role, dtype in chosen.items():
        if not device.supports(dtype):
            raise ValueError(f"role {role!r}: dtype {dtype} does not run on {device.name} (it runs "
                             f"{list(device.dtypes)}); pass dtypes={{{role!r}: {device.preferred_dtype!r}}}")
    return chosen


def _ranges(gpus: Sequence[int]) -> str:
    parts, run = [], [gpus[0]]
    for gpu in gpus[1:]:
        if gpu == run[-1] + 1:
            run.append(gpu)
        else:
            parts.append(run)
            run = [gpu]
    parts.append(run)
    return "+".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in parts)


def colocate_all_mapping(problem: Problem) -> dict[str, tuple[int, ...]]:
    """verl's default: every role on every GPU of the strongest device type (a group is one type)."""
    cluster = problem.cluster
    power = {name: sum(m.gpus for m in cluster.machines if m.device.name == name)
             * cluster.device(name).peak_flops(cluster.device(name).preferred_dtype) for name in cluster.device_names}
    device = max(cluster.device_names, key=lambda name: power[name])
    gpus = tuple(g for m in cluster.machines if m.device.name == device for g in m.gpu_ids)
    return {role: gpus for role in problem.role_names}


def even_split_mapping(problem: Problem) -> dict[str, tuple[int, ...]] | None:
    """OpenRLHF-style: each role its own equal share of GPUs, taken in id order within one device type.

    Returns None when the cluster has fewer GPUs than roles in any usable arrangement.
    """
    roles = problem.role_names
    share = problem.cluster.num_gpus // len(roles)
    while share >= 1:
        cluster = problem.cluster
        merged = [[g for m in cluster.machines if m.device.name == name for g in m.gpu_ids]
                  for name in cluster.device_names]
        mapping: dict[str, tuple[int, ...]] = {}
        for role in roles:
            fitting = [p for p in merged if len(p) >= share]
            if not fitting:
                break
            mapping[role] = tuple(fitting[0][:share])
            del fitting[0][:share]
        if len(mapping) == len(roles):
            return mapping
        share -= 1
    return None
