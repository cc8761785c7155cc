"""A rollout served by a fleet of inference servers behind a router (``rollout: server``), in the cost model.

A backend whose :class:`~hybridflow.planner.support.LayoutSupport` says ``served`` generates through N server
replicas behind one router. The plan sizes the fleet: the rollout's layout is its dp x tp, and a replica is one
engine of it, ``rollout_tp`` GPUs, so the fleet is ``dp * tp / rollout_tp`` replicas of tensor parallelism
``rollout_tp`` (:func:`fleet_replicas`). What serving adds to the in-process engine's costs:

- **No colocation with training.** The fleet is a group of its own (``<policy>:rollout``): the search plans a
  served policy's rollout detached only, and a mapping that puts it on the trainer's GPUs is refused. Training
  and generation then overlap only in the overlapped modes the planner already models for detached rollouts
  (``modes.py``); in ``sync`` they take turns.
- **The router.** Every request crosses one (one per sample; one per turn in a multi-turn node), and each costs
  ``Constants.router_request_s`` (vllm-router's added p50 latency, 0.42 ms measured: docs/benchmarks.md
  "Rollout servers"), taken as its service time: a router admits its requests one after another, and the model
  credits none of that to the decode it overlaps (an upper bound for a multi-threaded proxy). Where the fleet's
  GPUs are on one machine the runtime runs one fleet for the role, its rank 0 starting every replica (of
  ``rollout_tp`` GPUs, spanning ranks) and one router; across machines each rank runs a fleet of its own, and a
  generate node's requests split over its ranks' routers (:func:`fleet_routers`, :func:`router_seconds`). So a
  replica of ``rollout_tp`` > 1 is planned on one machine only (``layouts._rollout_candidates``).
- **The weight broadcast.** After an update the trainer ships one copy of the weights to the fleet's group (as to
  any detached rollout, ``weight_moves.weight_ship``); there it is written once as a snapshot that every replica
  reloads from its path (``reload_weights(weights_path=...)``), so each replica's copy crosses the link on its
  own, no relay tree: N copies through the writer's link at the cluster's inter-node bandwidth, the replicas
  paused meanwhile, each reloading tensor by tensor in parallel (:func:`fleet_sync`). It is the fleet's own work,
  charged to its first generate node in every mode.
"""

from __future__ import annotations

import math

from hybridflow.graph import NodeLoad
from hybridflow.planner.agents import AgentNode
from hybridflow.planner.costs import COLLECTIVE_LATENCY_S, Shape
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.plan import ROLLOUT_SUFFIX, Plan, RoleLayout
from hybridflow.planner.weight_moves import sync_payload

FLEET_KEY = "fleet"  # ``Plan.extra`` keys ``fleet/<role>/<field>`` describe a served rollout's fleet
FLEET_FIELDS = ("replicas", "tp", "group", "sync_bytes", "sync_s", "router_s", "requests", "routers")


def fleet_replicas(layout: RoleLayout) -> int:
    """Server replicas of a served rollout's layout: one per engine of ``rollout_tp`` GPUs."""
    return max(1, layout.dp * layout.tp // layout.rollout_tp)


def fleet_sync(model: ModelSpec, layout: RoleLayout, shape: Shape) -> tuple[float, int]:
    """Seconds and bytes to bring every replica the weights after an update (module docstring): one copy
    (adapter-only: the adapter's, :func:`~hybridflow.planner.weight_moves.sync_payload`) per replica over the
    link, plus one tensor-by-tensor reload, the replicas reloading in parallel."""
    full, fixed = sync_payload(model, layout)
    copies = fleet_replicas(layout)
    return copies * full / shape.inter + COLLECTIVE_LATENCY_S + fixed, int(copies * full)


def requests_of(load: NodeLoad, agent: AgentNode | None) -> int:
    """HTTP requests a generate node sends through the router: one per sample, one per turn of an agent's."""
    return round(load.sequences * (agent.turns.mean if agent is not None else 1.0))


def fleet_routers(layout: RoleLayout, shape: Shape) -> int:
    """Routers of a served rollout's fleet: one where its GPUs are on one machine (the role's one fleet), else one
    per rank (a fleet per rank)."""
    return 1 if shape.machines == 1 else layout.dp * layout.tp


def router_seconds(requests: int, shape: Shape, routers: int = 1) -> float:
    """Seconds the routers add to a generate node of ``requests`` requests spread over ``routers`` of them, each
    admitting its share one after another (module docstring)."""
    return math.ceil(requests / max(1, routers)) * shape.constants.router_request_s


def fleets(plan: Plan) -> dict[str, dict[str, float]]:
    """``{rollout role: {replicas, tp, group, sync_bytes, sync_s, router_s, requests, routers}}`` of a plan's served
    rollouts, read back from its ``extra``."""
    found: dict[str, dict[str, float]] = {}
    for key, value in plan.extra:
        prefix, _, rest = str(key).partition("/")
        role, _, name = rest.rpartition("/")
        if prefix == FLEET_KEY and role and name in FLEET_FIELDS:
            found.setdefault(role, {})[name] = float(value)
    return found


def describe_fleet(plan: Plan, role: str) -> str:
    """``actor:rollout: 8 server replicas x tp 1 on group 1 (8xH100-80G); weight sync per update ...``."""
    fleet = fleets(plan)[role]
    index = int(fleet["group"])
    group = plan.groups[index]
    return (f"{role}: {int(fleet['replicas'])} server replicas x tp {int(fleet['tp'])} on group {index} "
            f"({group.size}x{group.device}); weight sync per update {fleet['sync_bytes'] / 1e9:.3g} GB "
            f"({int(fleet['replicas'])} copies) {fleet['sync_s']:.3g} s; {int(fleet['requests'])} requests through "
            f"{int(fleet.get('routers', fleet['replicas']))} router(s) {fleet['router_s']:.3g} s")


def fleet_metrics(plan: Plan) -> dict[str, float]:
    """The planner's estimate of each served rollout's weight sync, keyed as its generate node's measured metrics
    (``<policy>/rollout/sync_s``, ``sync_bytes``: one snapshot, ``sync_replicas``) with ``_planned`` appended."""
    metrics = {}
    for role, fleet in fleets(plan).items():
        prefix = f"{role.removesuffix(ROLLOUT_SUFFIX)}/rollout/"
        metrics.update({prefix + "sync_s_planned": fleet["sync_s"],
                        prefix + "sync_bytes_planned": fleet["sync_bytes"] / fleet["replicas"],
                        prefix + "sync_replicas_planned": fleet["replicas"]})
    return metrics


def check_replicas(asked: int | None, layout: RoleLayout, *, world_size: int, logical: bool, role: str,
                   pooled: bool = False) -> int:
    """Server replicas this rank starts: the plan's share (the rank's GPUs, its layout's ``dp * tp`` over the
    role's ranks, in replicas of ``rollout_tp`` GPUs each; ``pooled``: the role's one fleet, which its rank 0 starts
    on all the role's GPUs), or ``asked`` (the user's ``replicas``) when it agrees with it. On logical GPUs
    (``logical``: CPU processes, where the plan's GPU is a share of the host's cores) ``asked`` stands as given:
    replicas are processes sharing those cores. A disagreement on real GPUs is refused: the plan sized the fleet and
    costed it so. A fleet per rank whose rank holds fewer GPUs than one replica needs is refused on both."""
    policy = role.removesuffix(ROLLOUT_SUFFIX)
    ranks = 1 if pooled else max(1, world_size)
    gpus = max(1, layout.dp * layout.tp // ranks)
    if layout.rollout_tp > gpus:
        raise ValueError(f"role {policy!r}: its layout of {role!r} (dp={layout.dp} x tp={layout.tp}, rollout_tp="
                         f"{layout.rollout_tp}) over {world_size} rank(s) gives each rank {gpus} GPU(s), fewer than "
                         f"one server replica of tensor parallelism {layout.rollout_tp} needs (a fleet per rank starts"
                         " whole replicas of its own GPUs); plan rollout_tp <= the GPUs per rank, or run the role's "
                         "ranks on one machine with rollout_options.fleet unset or role (replicas span ranks there)")
    share = gpus // layout.rollout_tp
    if asked is None or asked == share or logical:
        return share if asked is None else asked
    where = "for the role's one fleet" if pooled else "per rank"
    raise ValueError(f"role {policy!r}: its rollout option replicas={asked} disagrees with the plan: its "
                     f"layout of {role!r} (dp={layout.dp} x tp={layout.tp}, rollout_tp={layout.rollout_tp}) is "
                     f"{fleet_replicas(layout)} server replica(s) over {world_size} rank(s), {share} {where}. "
                     f"Drop the option (the plan sizes the fleet), or give {policy!r}'s rollout as many GPUs as "
                     "replicas you want (a mapping such as "
                     f"'{policy}{ROLLOUT_SUFFIX}=<GPUs>', or placement that plans them)")
