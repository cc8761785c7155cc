"""Execution modes in the cost model: ``sync`` and ``one_step_off`` (the runtime's ``pipeline``).

In ``one_step_off`` a policy's rollout on GPUs of its own generates the batch of step t+1 while the
trainer works on step t (``hybridflow/runtime/pipeline.py``). The schedule then lets the detached
generate node start at once on its group, and its consumers take the batch generated during the step
before (only its transfer to them is waited for); the rollout group's busy time also counts the engine
loading the weights the trainer ships (``weight_load``). The step is the later of the two pools:

    step = max(R, T) + step_overhead,   R = generate + load (+ other nodes on the rollout's GPUs),
    T = the makespan of every other node, the weight export included in the policy's last update.
"""

from __future__ import annotations

from hybridflow.graph import Graph, Op
from hybridflow.planner.plan import PIPELINES, ROLLOUT_SUFFIX, Plan, detachable_policies

CHOICES = (*PIPELINES, "auto")


def overlap_blocker(graph: Graph) -> str | None:
    """Why ``graph`` cannot run ``one_step_off`` (None when it can): the runtime overlaps one generate node
    of a detachable policy, and no filter (its resampling loop regenerates within the step)."""
    generates = [node for node in graph.nodes if node.op is Op.GENERATE]
    if len(generates) != 1 or graph.filter_node is not None:
        return (f"the {graph.name} graph has {len(generates)} generate node(s)"
                f"{' and a filter' if graph.filter_node is not None else ''}; one_step_off overlaps exactly one "
                "generate node with the rest of the step")
    if not detachable_policies(graph):
        return f"the {graph.name} graph's generate node belongs to no trainable policy, so no rollout can be detached"
    return None


def check_pipeline(pipeline: str, graph: Graph, *, detached: bool) -> None:
    """Refuse a mode the plan cannot run, naming the fix."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} must be one of {list(PIPELINES)} (or 'auto' to let the planner "
                         "choose)")
    if pipeline == "sync":
        return
    blocker = overlap_blocker(graph)
    if blocker is not None:
        raise ValueError(f"pipeline='one_step_off': {blocker}; use pipeline='sync'")
    if not detached:
        policy = detachable_policies(graph)[0]
        raise ValueError(f"pipeline='one_step_off' needs the rollout of {policy!r} on GPUs of its own, so that "
                         f"generation can overlap training; this mapping colocates it. Add "
                         f"'{policy}{ROLLOUT_SUFFIX}=<GPUs not shared with {policy}>' to the mapping (or let the "
                         "search split the pool: PlannerOptions(pipeline='one_step_off'), `hybridflow plan "
                         "--pipeline one_step_off` without --manual), or use pipeline='sync'")


def pool_seconds(plan: Plan) -> tuple[float, float]:
    """(rollout pool, trainer pool) busy seconds of a ``one_step_off`` plan's step, without the overhead."""
    rollout_groups = {plan.group_index(role) for role in plan.detached_rollouts.values()}
    rollout = max((n.end_s for n in plan.nodes if n.group in rollout_groups), default=0.0)
    trainer = max((n.end_s for n in plan.nodes if n.group not in rollout_groups), default=0.0)
    return rollout, trainer


def describe_mode(plan: Plan) -> str:
    """``one_step_off on 4+4 GPUs: generation 120 s overlaps training 95 s`` or ``sync colocated on 8 GPUs``."""
    if plan.pipeline == "one_step_off":
        rollout, trainer = pool_seconds(plan)
        rollout_gpus = sum(plan.groups[i].size for i in {plan.group_index(r) for r in plan.detached_rollouts.values()}
                           if i is not None)
        pace = "rollout paces the step" if rollout >= trainer else "trainer paces the step"
        return (f"one_step_off on {rollout_gpus}+{plan.num_gpus - rollout_gpus} GPUs (rollout+trainer): "
                f"generation {rollout:.3g} s overlaps training {trainer:.3g} s, {pace}")
    layout = "split" if plan.detached_rollouts else "colocated"
    return f"sync {layout} on {plan.num_gpus} GPUs: {plan.step_time_s:.3g} s"


def explain_choice(chosen: Plan, rivals: list[Plan]) -> str:
    """Which mode won and what the others cost, in one line, for the plan's ``extra["pipeline_choice"]``."""
    others = "; ".join(f"{_label(rival)} {rival.step_time_s:.3g} s" for rival in rivals)
    return f"{describe_mode(chosen)}; step {chosen.step_time_s:.3g} s" + (f" vs {others}" if others else "")


def _label(plan: Plan) -> str:
    return f"{plan.pipeline} {'split' if plan.detached_rollouts else 'colocated'}"
