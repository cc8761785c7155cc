"""Streaming within a step: the rows of a generate node flow on in chunks as they finish.

With ``stream_chunks=m`` the controller splits a step's prompts into m chunks (a prompt's n samples stay
together) and generates them one after another on the rollout. When a chunk's responses are done, the
row-wise forward nodes that read them (scores, reference / actor log-probs, values) start on that chunk
at once, on their own groups or on the driver, while the next chunk still decodes: a reward function, a
reference on other GPUs or a trainer pool beside a detached rollout no longer waits for the slowest
response of the whole batch. Nodes that need the whole batch (advantages, filters, updates) run after the
last chunk, on the chunks' outputs joined in row order (response-aligned fields right-padded to the
batch's longest response). Chunk ``i`` samples with the step's seed plus ``i`` x 1,000,003: a streamed run
is reproducible, but its samples differ from an unchunked run's (greedy decoding gives the same ones).
Streaming applies to ``sync`` steps; ``one_step_off`` and ``async`` already take generation off the
step's critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from hybridflow.graph import Graph, Node
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.dispatch import Outcome, Target

CHUNK_SEED_STRIDE = 1_000_003


def streamed_section(graph: Graph) -> tuple[Node, list[Node]] | None:
    """The generate node a step can stream from and the row-wise nodes that follow it chunk by chunk
    (``Graph.streamed_followers``, the rule the planner costs too); None when the graph has no single generate
    node (or has a filter, whose rounds regenerate)."""
    generate = graph.lone_generate
    if generate is None:
        return None
    return generate, [graph.node(name) for name in graph.streamed_followers]


@dataclass
class Streamed:
    """What streaming a step produced: the joined rows, each node's summed seconds and last metrics."""

    rows: Batch
    outcomes: dict[str, Outcome]


def run_streamed(graph: Graph, rows: Batch, chunks: int, *, target_of: Callable[[Node], Target], seed: int,
                 samples: int) -> Streamed:
    """Run the streamed section on ``rows`` (one row per sample) in ``chunks`` chunks (see the module)."""
    section = streamed_section(graph)
    assert section is not None
    generate, followers = section
    prompts = len(rows) // samples
    per_chunk = -(-prompts // chunks) * samples
    states = [rows.slice(start, min(start + per_chunk, len(rows))) for start in range(0, len(rows), per_chunk)]
    running: dict[Future[Outcome], tuple[Node, int]] = {}
    done: list[set[str]] = [set() for _ in states]
    outputs: dict[str, list[Batch]] = {node.name: [Batch({})] * len(states) for node in [generate, *followers]}
    seconds: dict[str, float] = {}
    metrics: dict[str, Mapping[str, float]] = {}

    def submit(node: Node, index: int, chunk_seed: int) -> None:
        running[target_of(node).submit_rows(node, states[index], chunk_seed)] = (node, index)

    for index in range(len(states)):  # queued in order on the rollout: chunk 0 finishes first
        submit(generate, index, seed + index * CHUNK_SEED_STRIDE)
    while running:
        finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
        for future in finished:
            node, index = running.pop(future)
            outcome = future.result()
            states[index] = states[index].union(outcome.outputs)
            outputs[node.name][index] = outcome.outputs
            seconds[node.name] = seconds.get(node.name, 0.0) + outcome.seconds
            metrics[node.name] = outcome.metrics
            done[index].add(node.name)
            for follower in followers:
                ready = set(graph.predecessors(follower.name)) <= done[index]
                if ready and follower.name not in done[index] and (follower, index) not in running.values():
                    submit(follower, index, seed)
    produced = {name for parts in outputs.values() for part in parts for name in part.tensors}
    joined = Batch.concat([_padded(state, _width(states), produced) for state in states])
    return Streamed(rows=joined, outcomes={name: Outcome(Batch({}), metrics.get(name, {}), seconds.get(name, 0.0))
                                           for name in outputs})


def _width(states: list[Batch]) -> int:
    return max(int(state["responses"].shape[1]) for state in states)


def _padded(state: Batch, width: int, produced: set[str]) -> Batch:
    """``state`` with the response-aligned fields the section ``produced`` right-padded to ``width`` (zeros;
    responses with their own padding token)."""
    own = int(state["responses"].shape[1])
    if own == width:
        return state
    mask = state["response_mask"]
    off = mask == 0
    pad = int(state["responses"][off][0]) if bool(off.any()) else 0
    tensors = {}
    for name, value in state.tensors.items():
        if name in produced and value.dim() >= 2 and value.shape[1] == own:
            extra = torch.full((value.shape[0], width - own, *value.shape[2:]), pad if name == "responses" else 0,
                               dtype=value.dtype)
            value = torch.cat([value, extra], dim=1)
        tensors[name] = value
    return Batch(tensors, state.non_tensors)
