"""Execution modes in the cost model: ``sync``, ``one_step_off`` and ``async`` (the runtime's ``pipeline``).

In ``one_step_off`` a policy's rollout on GPUs of its own generates the batch of step t+1 while the
trainer works on step t (``hybridflow/runtime/pipeline.py``). The schedule then lets the detached
generate node start at once on its group, and its consumers take the batch generated during the step
before (only its transfer to them is waited for); the rollout group's busy time also counts the engine
loading the weights the trainer ships (``weight_load``). The step is the later of the two pools:

    step = max(R, T) + step terms,   R = generate + load (+ other nodes on the rollout's GPUs),
    T = the makespan of every other node, the weight export included in the policy's last update.

``async`` with ``max_staleness`` k: the detached pool generates continuously. When a sequence finishes a
prompt of a later batch takes its slot (continuous batching across steps), a weight update lands between
decode segments (in-flight sequences continue under the new weights) after pausing the pool for the load,
the trainer takes a batch once its longest response is done, and a batch's prompts enter at most k
updates ahead of the trainer. In steady state, with step period P:

    P >= R_async = stream + load    the pool's time for one batch's tokens at full occupancy (mean length)
    P >= T                          the trainer pool, as in one_step_off
    (k+1)·P >= D + T                a batch enters k+1 trainer steps before its training ends, so its
                                    latency D (first prompt to longest response) and its training fit there
    step = max(R_async, T, (D + T) / (k + 1)) + step terms (step_terms.py)

D is taken as the synchronous generation time of one batch on the pool (tail-bound, ``generate_cost``):
the latency of a batch whose longest response decodes beside the others. That one term is what k buys in
this model: a larger k spreads a batch's long tail over more trainer steps. Per-step variance of R and T
is not modelled, nor what staleness costs in learning per sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hybridflow.graph import Graph, NodeLoad, Op
from hybridflow.planner.costs import Shape
from hybridflow.planner.devices import DTYPE_BYTES
from hybridflow.planner.execution import PIPELINES, ExecutionMode
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.plan import ROLLOUT_SUFFIX, Plan, RoleLayout, detachable_policies
from hybridflow.planner.rollout import Engine, concurrency, decode_seconds, generate_cost

CHOICES = (*PIPELINES, "auto")
OVERLAPPED = ("one_step_off", "async")  # modes in which a detached rollout overlaps the trainer
DEFAULT_STALENESS = (1, 2)  # the bounds ``async`` and ``auto`` compare when none is given


def check_choice(pipeline: str, max_staleness: int | None, stream_chunks: int = 1, *,
                 key: Callable[[str], str] = str) -> None:
    """Refuse a requested mode (one of :data:`PIPELINES`, or ``auto`` for the planner to choose) whose values
    are wrong, naming each field as ``key(field)``; ``auto`` is checked as async, the mode its bound applies to."""
    if pipeline not in CHOICES:
        raise ValueError(f"{key('pipeline')}={pipeline!r} must be one of {list(CHOICES)}")
    if pipeline == "auto" and stream_chunks != 1:
        raise ValueError(f"{key('stream_chunks')}={stream_chunks} with pipeline='auto': streaming is costed within a "
                         "sync step; name pipeline='sync' or use stream_chunks=1")
    ExecutionMode.checked(key=key, pipeline="async" if pipeline == "auto" else pipeline, max_staleness=max_staleness,
                          stream_chunks=stream_chunks)


def overlap_blocker(graph: Graph, pipeline: str = "one_step_off") -> str | None:
    """Why ``graph`` cannot run ``pipeline`` with an overlapped rollout (None when it can): the runtime
    overlaps one generate node of a detachable policy, and no filter (its resampling loop regenerates
    within the step)."""
    if graph.lone_generate is None:
        count = sum(node.op is Op.GENERATE for node in graph.nodes)
        return (f"the {graph.name} graph has {count} generate node(s)"
                f"{' and a filter' if graph.filter_node is not None else ''}; {pipeline} overlaps exactly one "
                "generate node with the rest of the step")
    if not detachable_policies(graph):
        return f"the {graph.name} graph's generate node belongs to no trainable policy, so no rollout can be detached"
    return None


def check_pipeline(mode: ExecutionMode, graph: Graph, *, detached: bool) -> None:
    """Refuse a mode the mapping cannot run, naming the fix."""
    pipeline = mode.pipeline
    check_stream_chunks(graph, mode)
    if not mode.overlapped:
        return
    blocker = overlap_blocker(graph, pipeline)
    if blocker is not None:
        raise ValueError(f"pipeline={pipeline!r}: {blocker}; use pipeline='sync'")
    if not detached:
        policy = detachable_policies(graph)[0]
        raise ValueError(f"pipeline={pipeline!r} needs the rollout of {policy!r} on GPUs of its own, so that "
                         f"generation can overlap training; this mapping colocates it. Add "
                         f"'{policy}{ROLLOUT_SUFFIX}=<GPUs not shared with {policy}>' to the mapping (or let the "
                         f"search split the pool: PlanRequest(..., pipeline={pipeline!r}), `hybridflow plan "
                         f"--pipeline {pipeline}` without --manual), or use pipeline='sync'")


def check_stream_chunks(graph: Graph, mode: ExecutionMode) -> None:
    """Refuse a streamed step (``mode.stream_chunks`` > 1) the graph cannot run, naming the fix: it needs one
    sampling generate node fed by the step's inputs only, any other generate answering its rows one by one (an LLM
    judge's, ``Graph.stream_generate``); the values themselves are the mode's to check."""
    chunks = mode.stream_chunks
    if chunks == 1:
        return
    if graph.stream_generate is None:
        raise ValueError(f"stream_chunks={chunks}: the {graph.name} graph has no single sampling generate node fed by "
                         "the step's inputs whose other generates answer its rows one by one (or it has a filter), so "
                         "there is nothing to stream: use stream_chunks=1")


def streamed_generate_seconds(model: ModelSpec, load: NodeLoad, prompt_len: int, layout: RoleLayout, shape: Shape,
                              resident: float = 0.0) -> tuple[float, float]:
    """(pool seconds per batch in ``async``, the synchronous generation time of the batch) on a detached pool.

    The pool seconds replace the synchronous decode (bulk plus the last cohort draining to the longest
    response) by every token of the engine's share decoded at full concurrency: ``per_engine · mean / c``
    decode steps at the mean in-flight context, the engine's steady state when finished slots are refilled
    from later batches. Prefill and the phase overhead are the synchronous ones. Never above the
    synchronous time (the pool could always run one batch as a synchronous engine does).
    """
    synchronous = generate_cost(model, load, prompt_len, layout, shape, resident).seconds
    prompt_len += load.row_image_tokens  # the context a vision-language model's engine holds (generate_cost adds it)
    engine = Engine(model, shape, layout.rollout_tp, DTYPE_BYTES[layout.dtype])
    rows = max(load.sequences, 1)
    per_engine = math.ceil(rows / max(1, shape.size // layout.rollout_tp))
    lengths = shape.run.response_lengths(max(1, load.response_tokens // rows))
    in_flight = concurrency(engine, per_engine, layout.rollout_batch_size or per_engine, prompt_len, lengths,
                            resident)
    tail_bound = decode_seconds(engine, per_engine, in_flight, prompt_len, lengths, rows)
    steady = per_engine * lengths.mean / in_flight * engine.step_seconds(in_flight, prompt_len + lengths.mean_age())
    return synchronous - max(0.0, tail_bound - steady), synchronous


def async_step(rollout_s: float, trainer_s: float, latency_s: float, max_staleness: int) -> float:
    """An ``async`` step without the step terms: the slower pool, or a batch's latency plus its training
    spread over the ``max_staleness + 1`` trainer steps it may take (module docstring)."""
    return max(rollout_s, trainer_s, (latency_s + trainer_s) / (max_staleness + 1))


def pool_seconds(plan: Plan) -> tuple[float, float]:
    """(rollout pool, trainer pool) busy seconds of an overlapped plan's step, without the step terms."""
    rollout_groups = {plan.group_index(role) for role in plan.detached_rollouts.values()}
    rollout = max((n.end_s for n in plan.nodes if n.group in rollout_groups), default=0.0)
    trainer = max((n.end_s for n in plan.nodes if n.group not in rollout_groups), default=0.0)
    return rollout, trainer


def describe_mode(plan: Plan) -> str:
    """``one_step_off on 4+4 GPUs: generation 120 s overlaps training 95 s`` or ``sync colocated on 8 GPUs``."""
    if plan.pipeline not in OVERLAPPED:
        layout = "split" if plan.detached_rollouts else "colocated"
        chunks = plan.mode.stream_chunks
        streamed = f", streamed in {chunks} chunks" if chunks > 1 else ""
        return f"sync {layout} on {plan.num_gpus} GPUs{streamed}: {plan.step_time_s:.3g} s"
    rollout, trainer = pool_seconds(plan)
    rollout_gpus = sum(plan.groups[i].size for i in {plan.group_index(r) for r in plan.detached_rollouts.values()}
                       if i is not None)
    split = f"{rollout_gpus}+{plan.num_gpus - rollout_gpus} GPUs (rollout+trainer)"
    if plan.pipeline == "one_step_off":
        pace = "rollout paces the step" if rollout >= trainer else "trainer paces the step"
        return f"one_step_off on {split}: generation {rollout:.3g} s overlaps training {trainer:.3g} s, {pace}"
    k = plan.max_staleness
    latency = float(dict(plan.extra).get("batch_latency_s", 0.0))
    spread = (latency + trainer) / (k + 1)
    pace = max((rollout, "rollout throughput paces the step"), (trainer, "trainer paces the step"),
               (spread, f"the batch latency spread over {k + 1} steps paces the step"), key=lambda p: p[0])[1]
    return (f"async k={k} on {split}: streamed generation {rollout:.3g} s overlaps training {trainer:.3g} s, "
            f"batch latency {latency:.3g} s, {pace}")


def explain_choice(chosen: Plan, rivals: list[Plan]) -> str:
    """Which mode won and what the others cost, in one line, for the plan's ``extra["pipeline_choice"]``."""
    others = "; ".join(f"{_label(rival)} {rival.step_time_s:.3g} s" for rival in rivals)
    return f"{describe_mode(chosen)}; step {chosen.step_time_s:.3g} s" + (f" vs {others}" if others else "")


def _label(plan: Plan) -> str:
    mode = f"async k={plan.max_staleness}" if plan.pipeline == "async" else plan.pipeline
    return f"{mode} {'split' if plan.detached_rollouts else 'colocated'}"
