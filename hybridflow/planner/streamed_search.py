"""The search's streamed candidates: a sync step whose graph can stream (``Graph.stream_generate``), costed both ways.

Streaming changes which placement is fastest (a judge on GPUs of its own answers the first chunk while the next one
decodes; beside the rollout it queues behind every chunk), so the unstreamed winner streamed is not enough: each
colocation partition's best unstreamed allocation (the search restricted to it) is costed streamed in the request's
``stream_chunks`` with the same GPUs and parallel sizes (``evaluate_mapping``, the runtime's chunk rule), and the
fastest of those is compared with the unstreamed plan. The allocation within a partition is the unstreamed one, not
searched again for streaming: a streamed step can prefer another split of the same partition, which this misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hybridflow.planner.assemble import Placement
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.plan import ROLLOUT_SUFFIX, Plan
from hybridflow.planner.request import PlanRequest


def streamed_plan(request: PlanRequest, placements: Sequence[Placement]) -> Plan | None:
    """``placements`` (one partition's unstreamed best) costed as a sync step streamed in ``request.stream_chunks``,
    with the same GPUs, data-parallel and rollout sizes and dtypes; None where it does not fit."""
    mapping = {role: list(placement.gpus) for placement in placements for role in placement.roles}
    layouts = [layout for placement in placements for layout in placement.layout.layouts]
    trained = {lay.role: lay.dp for lay in layouts if not lay.role.endswith(ROLLOUT_SUFFIX)}
    plan = evaluate_mapping(replace(request, pipeline="sync"), mapping, data_parallel_size=trained, sharding=None,
                            rollout_tp={lay.role: lay.rollout_tp for lay in layouts},
                            dtypes={lay.role: lay.dtype for lay in layouts})
    return plan if plan.feasible else None


def stream_choice(chosen: Plan, unstreamed: Plan, streamed: Sequence[Plan], generate: str) -> str:
    """Why ``chosen`` (the fastest of ``streamed``, or ``unstreamed`` itself) won, in one line for the plan's
    ``extra["stream_choice"]``; ``generate``: the node the step streams from."""
    if chosen.mode.stream_chunks == 1:
        best = min((plan.step_time_s for plan in streamed), default=None)
        tried = f"streamed, the best of {len(streamed)} partitions {best:.3g} s" if best is not None else "none fits"
        return (f"unstreamed: step {unstreamed.step_time_s:.3g} s; {tried} (each chunk pays its own decode tail and "
                "phase overheads)")
    nodes = {node.node: node for node in chosen.nodes}
    early = [name for name, node in nodes.items() if name != generate and node.start_s < nodes[generate].end_s
             and node.group != nodes[generate].group]  # on the driver or other GPUs, beside the next chunk's decode
    overlap = f"; running beside {generate}'s later chunks: {', '.join(early)}" if early else ""
    return (f"streamed in {chosen.mode.stream_chunks} chunks: step {chosen.step_time_s:.3g} s against "
            f"{unstreamed.step_time_s:.3g} s unstreamed{overlap}")
