"""Per-role parallel layouts and the best joint layout of the roles sharing one group.

A role's candidates are kept on a Pareto front of (busy seconds, resident bytes, transient bytes);
colocated roles add resident bytes and busy seconds and share the transient peak, so the group's
best layout is found by merging fronts, which is exact (a dominated candidate is never needed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.planner.agents import rollout_cost
from hybridflow.planner.costs import FULL_SHARDS, USABLE_MEMORY, Shape, forward_cost, static_bytes, update_cost
from hybridflow.planner.fleet import fleet_sync
from hybridflow.planner.plan import RoleLayout, Sharding
from hybridflow.planner.problem import RoleWork
from hybridflow.planner.support import ANY_LAYOUT, LayoutSupport
from hybridflow.planner.weight_moves import engine_switch, weight_ship, weight_sync

POWERS = (1, 2, 4, 8, 16, 32, 64)
ROLLOUT_BATCHES = (8, 32, 128, 512, 2048)
TRAIN_SHARDINGS = (Sharding.NO_SHARD, Sharding.SHARD_GRAD_OP, Sharding.FULL_SHARD)
Front2 = list[tuple[int, float, RoleLayout]]  # (transient bytes, seconds, layout) with seconds decreasing


@dataclass(frozen=True)
class Candidate:
    """One layout of one role on one shape: busy seconds and bytes per GPU."""

    layout: RoleLayout
    seconds: float
    static: int
    transient: int


@dataclass(frozen=True)
class GroupLayout:
    """The chosen layouts of a group's roles, their node times and the group's memory per GPU."""

    layouts: tuple[RoleLayout, ...]
    node_seconds: tuple[tuple[str, float], ...]
    busy_seconds: float
    memory_bytes: int
    weight_sync_bytes: int
    weight_sync_seconds: float = 0.0
    batch_latency_s: float = 0.0  # async: a batch's synchronous generation time on this (rollout) group


def replace(layout: RoleLayout, **changes: Any) -> RoleLayout:
    """``dataclasses.replace`` without re-validation: this runs ~10^5 times per search on values the
    enumeration already keeps valid, and the validating constructor dominated planning time."""
    fresh = object.__new__(RoleLayout)
    fresh.__dict__.update(layout.__dict__, **changes)
    return fresh


def usable_bytes(shape: Shape) -> int:
    return int(shape.device.memory_bytes * USABLE_MEMORY)


def _front2(points: Iterable[tuple[int, float, RoleLayout]]) -> Front2:
    """Keep points no other point beats on both transient bytes and seconds."""
    front: Front2 = []
    for point in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or point[1] < front[-1][1]:
            front.append(point)
    return front


def _tps(role: RoleWork, shape: Shape) -> list[int]:
    heads = role.model.heads
    return [tp for tp in (1, 2, 4, 8) if shape.size % tp == 0 and shape.tp_allowed(tp) and heads % tp == 0]


def _training_tps(role: RoleWork, shape: Shape, max_tp: int | None) -> list[int]:
    """Tensor parallelism of training and forward passes: each rank holds whole query and key-value heads
    (Megatron's rule; a rollout engine may replicate KV heads instead, :func:`_tps`)."""
    return [tp for tp in _tps(role, shape) if (max_tp is None or tp <= max_tp) and role.model.kv_heads % tp == 0]


def _micro_batches(rows: int) -> list[int]:
    return [size for size in POWERS if size <= max(rows, 1)]


def _frozen_equivalent(role: RoleWork, sharding: Sharding) -> Sharding:
    """A frozen role has no gradients or optimizer states: only parameter sharding means anything."""
    if role.kind.trainable or sharding in (Sharding.FULL_SHARD, Sharding.ZERO3, Sharding.HYBRID_SHARD):
        return sharding
    return Sharding.NO_SHARD


def _update_front(role: RoleWork, base: RoleLayout, shape: Shape, fixed_mbs: int | None,
                  fixed_checkpointing: bool | None = None, *, support: LayoutSupport = ANY_LAYOUT) -> Front2:
    if not role.update:
        return [(0, 0.0, base)]
    points = []
    checkpointing = (False, True) if support.gradient_checkpointing else (False,)
    if fixed_checkpointing is not None:
        checkpointing = (fixed_checkpointing,)
    for mbs in [fixed_mbs] if fixed_mbs else _micro_batches(-(-role.rows // base.dp)):
        for checkpoint in checkpointing:
            layout = replace(base, micro_batch_size=mbs, gradient_checkpointing=checkpoint)
            costs = [update_cost(role.model, role.kind, load, layout, shape) for load in role.update]
            seconds = sum(c.seconds for c in costs)
            if role.ships_to:
                seconds += weight_ship(role.model, layout, shape)[0]
            points.append((max(c.transient_bytes for c in costs), seconds, layout))
    return _front2(points)


def _forward_front(role: RoleWork, base: RoleLayout, shape: Shape, fixed_mbs: int | None) -> Front2:
    if not role.forward:
        return [(0, 0.0, base)]
    points = []
    for mbs in [fixed_mbs] if fixed_mbs else _micro_batches(-(-role.rows // base.dp)):
        layout = replace(base, forward_micro_batch_size=mbs)
        costs = [forward_cost(role.model, role.kind, load, layout, shape) for load in role.forward]
        points.append((max(c.transient_bytes for c in costs), sum(c.seconds for c in costs), layout))
    return _front2(points)


def _generate_front(role: RoleWork, base: RoleLayout, shape: Shape, prompt_len: int,
                    fixed_rtp: int | None = None, *, support: LayoutSupport = ANY_LAYOUT) -> Front2:
    if not role.generate:
        return [(0, 0.0, base)]
    points = []
    resident = static_bytes(role.model, role.kind, base, shape)
    for rtp in [fixed_rtp] if fixed_rtp else support.rollout_tps(_tps(role, shape), base.tp):
        per_engine = -(-role.rows // (shape.size // rtp))
        # A backend that decodes a rank's whole share at once is costed so.
        batches = {b for b in ROLLOUT_BATCHES if b < per_engine} if support.rollout_batch_size else set()
        for batch in sorted(batches | {per_engine}):
            layout = replace(base, rollout_tp=rtp, rollout_batch_size=batch)
            costs = [rollout_cost(role.model, load, prompt_len, layout, shape, resident, role.agent(load.node))
                     for load in role.generate]
            seconds = sum(c.seconds for c in costs)
            if role.update:
                seconds += weight_sync(role.model, layout, shape)[0]
                seconds += engine_switch(role.model, role.kind, layout, shape)
            if role.served:  # more replicas: more copies of the weights to send (fleet.py)
                seconds += fleet_sync(role.model, layout, shape)[0]
            points.append((max(c.transient_bytes for c in costs), seconds, layout))
    return _front2(points)


def _merge(parts: Sequence[Front2]) -> list[tuple[int, float, tuple[RoleLayout, ...]]]:
    """Combine independent choices: the transient peak is the max, seconds add up."""
    thresholds = sorted({point[0] for part in parts for point in part})
    merged = []
    for limit in thresholds:
        chosen = []
        for part in parts:
            fits = [point for point in part if point[0] <= limit]
            if not fits:
                break
            chosen.append(fits[-1])  # the fastest point within the limit (seconds fall along a front)
        else:
            merged.append((limit, sum(point[1] for point in chosen), tuple(point[2] for point in chosen)))
    best: list[tuple[int, float, tuple[RoleLayout, ...]]] = []
    for point in merged:
        if not best or point[1] < best[-1][1]:
            best.append(point)
    return best


def _shardings(role: RoleWork, dp: int, shape: Shape) -> tuple[Sharding, ...]:
    if dp == 1:
        return (Sharding.NO_SHARD,)
    if not role.kind.trainable:
        return (Sharding.NO_SHARD, Sharding.FULL_SHARD)
    return TRAIN_SHARDINGS + ((Sharding.HYBRID_SHARD,) if shape.machines > 1 else ())


@dataclass(frozen=True, kw_only=True)
class Constraint:
    """Layout fields a user fixed (a manual mapping); None leaves the field to the planner."""

    tp: int | None = None
    sharding: Sharding | None = None
    micro_batch_size: int | None = None
    rollout_tp: int | None = None
    sp: int = 1
    pp: int = 1
    ep: int = 1
    shard_size: int = 0
    gradient_checkpointing: bool | None = None


def role_candidates(role: RoleWork, shape: Shape, dtype: str, prompt_len: int,
                    constraint: Constraint | None = None, *, max_tp: int | None = None,
                    support: LayoutSupport = ANY_LAYOUT) -> list[Candidate]:
    """The Pareto front of one role's layouts on ``shape``: (seconds, resident bytes, transient bytes).

    ``max_tp`` caps the tensor parallelism of training and forward passes (not of rollout engines);
    ``support`` keeps only the layouts the role's backend runs as planned (its tp, shardings, gradient
    checkpointing and rollout engine).
    """
    fixed = constraint or Constraint()
    if role.generates_only:
        return _rollout_candidates(role, shape, dtype, prompt_len, fixed, support)
    candidates = []
    forwards: dict[tuple[int, Sharding | None], Front2] = {}
    rollouts: dict[tuple[int, Sharding], Front2] = {}
    offload = shape.run.offload_of(role.name)
    offloaded = frozenset(part for part in ("params", "grads", "optimizer") if getattr(offload, part))
    tps = [fixed.tp] if fixed.tp else support.tps(_training_tps(role, shape, max_tp))
    for tp in tps:
        dp = shape.size // tp
        shardings = _shardings(role, dp, shape)
        if fixed.sharding is not None:
            shardings = (_frozen_equivalent(role, fixed.sharding) if dp > 1 else Sharding.NO_SHARD,)
        shardings = tuple(s for s in shardings if dp == 1 or support.runs_sharding(s))
        # A backend offloading these parts under some shardings only is searched under those; one that cannot
        # offload them at all is left to the controller's refusal (runtime.checks), which names the field.
        if not support.offload_problems(offloaded, Sharding.NO_SHARD, 1):
            shardings = tuple(s for s in shardings if dp == 1 or not support.offload_problems(offloaded, s, dp))
        for sharding in shardings:
            base = RoleLayout(role=role.name, dp=dp, tp=tp, sharding=sharding, dtype=dtype, sp=fixed.sp,
                              pp=fixed.pp, ep=fixed.ep, shard_size=fixed.shard_size, padding=shape.run.padding,
                              max_tokens_per_micro_batch=role.token_budget or shape.run.train_tokens_per_gpu or 0,
                              forward_max_tokens_per_micro_batch=(role.token_budget or shape.run.forward_tokens_per_gpu
                                                                  or 0),
                              offload_params=offload.params, offload_grads=offload.grads,
                              offload_optimizer=offload.optimizer)
            static = static_bytes(role.model, role.kind, base, shape)
            if static > usable_bytes(shape) and constraint is None:
                continue
            # Forward costs see sharding only through parameter gathers, rollout costs only through
            # whether the training weights can be reused in place: share fronts across the rest.
            forward_key = (tp, sharding if sharding in FULL_SHARDS else None)
            if forward_key not in forwards:
                forwards[forward_key] = _forward_front(role, base, shape, fixed.micro_batch_size)
            # Generation depends on the sharding through the weights' reuse and the resident bytes.
            rollout_key = (tp, sharding)
            if rollout_key not in rollouts:
                rollouts[rollout_key] = _generate_front(role, base, shape, prompt_len, fixed.rollout_tp,
                                                        support=support)
            parts = [_update_front(role, base, shape, fixed.micro_batch_size, fixed.gradient_checkpointing,
                                   support=support),
                     forwards[forward_key],
                     rollouts[rollout_key]]
            for transient, seconds, (upd, fwd, gen) in _merge(parts):
                layout = replace(upd, forward_micro_batch_size=fwd.forward_micro_batch_size,
                                 rollout_tp=gen.rollout_tp, rollout_batch_size=gen.rollout_batch_size)
                if not role.update:
                    layout = replace(layout, micro_batch_size=max(1, fwd.forward_micro_batch_size))
                candidates.append(Candidate(layout, seconds, static, transient))
    return pareto3(candidates)


def _rollout_candidates(role: RoleWork, shape: Shape, dtype: str, prompt_len: int,
                        fixed: Constraint, support: LayoutSupport = ANY_LAYOUT) -> list[Candidate]:
    """A generate-only role (a detached rollout) holds nothing but its engines' weight shards and KV cache.

    Costs are taken with the training tp equal to the engine's (so the weights are counted once, as the
    engine's); the layout keeps tp=1, dp=GPUs: every rank takes a share of the rows. A served rollout's replica
    spans ranks on one machine only (its role's one fleet, :mod:`~hybridflow.planner.fleet`): across machines its
    engines are one GPU each.
    """
    candidates = []
    rtps = support.rollout_tps(_tps(role, shape))
    if role.served and shape.machines > 1:
        rtps = [1]
    for rtp in [fixed.rollout_tp] if fixed.rollout_tp else rtps:
        engine = RoleLayout(role=role.name, dp=shape.size // rtp, tp=rtp, dtype=dtype, rollout_tp=rtp)
        static = static_bytes(role.model, role.kind, engine, shape)
        for transient, seconds, layout in _generate_front(role, engine, shape, prompt_len, rtp, support=support):
            candidates.append(Candidate(replace(layout, dp=shape.size, tp=1), seconds, static, transient))
    return pareto3(candidates)


def engine_layout(layout: RoleLayout) -> RoleLayout:
    """The layout a detached rollout's costs are taken with: its engines' tensor parallelism as ``tp``."""
    return replace(layout, dp=layout.dp * layout.tp // layout.rollout_tp, tp=layout.rollout_tp)


def pareto3(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Drop candidates another one matches or beats on seconds, resident and transient bytes."""
    kept: list[Candidate] = []
    for cand in sorted(candidates, key=lambda c: (c.seconds, c.static + c.transient, c.static)):
        if not any(k.static <= cand.static and k.transient <= cand.transient for k in kept):
            kept.append(cand)
    return kept


def best_combination(fronts: Sequence[Sequence[Candidate]], capacity: float) -> tuple[Candidate, ...] | None:
    """Colocated roles: minimum total busy seconds with resident sum + transient max within ``capacity``.

    Depth-first over roles, fastest candidates first, cut by two bounds: the seconds still to add are at
    least each remaining role's fastest, and the memory at least each remaining role's smallest.
    """
    ordered = [sorted(front, key=lambda c: (c.seconds, c.static + c.transient, c.static)) for front in fronts]
    if any(not front for front in ordered):
        return None
    min_seconds = [min(c.seconds for c in front) for front in ordered]
    min_static = [min(c.static for c in front) for front in ordered]
    min_peak = [min(c.transient for c in front) for front in ordered]
    rest_seconds = [sum(min_seconds[i:]) for i in range(len(ordered) + 1)]
    rest_static = [sum(min_static[i:]) for i in range(len(ordered) + 1)]
    rest_peak = [max(min_peak[i:], default=0) for i in range(len(ordered) + 1)]
    best: list[tuple[float, tuple[Candidate, ...]]] = []

    def visit(depth: int, static: int, peak: int, seconds: float, chosen: tuple[Candidate, ...]) -> None:
        if depth == len(ordered):
            if not best or seconds < best[0][0]:
                best[:] = [(seconds, chosen)]
            return
        for cand in ordered[depth]:
            total = seconds + cand.seconds
            if best and total + rest_seconds[depth + 1] >= best[0][0]:
                break  # candidates are sorted by seconds: every later one is slower still
            grown, top = static + cand.static, max(peak, cand.transient)
            if grown + rest_static[depth + 1] + max(top, rest_peak[depth + 1]) > capacity:
                continue
            visit(depth + 1, grown, top, total, (*chosen, cand))

    visit(0, 0, 0, 0.0, ())
    return best[0][1] if best else None


def smallest_combination(fronts: Sequence[Sequence[Candidate]]) -> tuple[Candidate, ...]:
    """A combination needing little memory per GPU (each role's smallest), to report an overflow."""
    return tuple(min(front, key=lambda c: (c.static + c.transient, c.seconds)) for front in fronts)
