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

from dataclasses import dataclass, field

from hybridflow.graph import Graph, Node
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.scheduler import Partition
from hybridflow.runtime.step_store import Join, right_pad

CHUNK_SEED_STRIDE = 1_000_003


def streamed_section(graph: Graph) -> tuple[Node, list[Node]] | None:
    """The generate node a step can stream from and the row-wise nodes that follow it chunk by chunk
    (``Graph.streamed_followers``, the rule the planner costs too); None when the graph has no single generate
    node (or has a filter, whose rounds regenerate)."""
    generate = graph.lone_generate
    if generate is None:
        return None
    return generate, [graph.node(name) for name in graph.streamed_followers]


@dataclass(kw_only=True)
class StreamChunks:
    """A streamed step's partitions (:mod:`.scheduler`): the rows (one per sample) in ``chunks`` slices of
    whole prompts, each a chunk partition of the streamed section, joined in row order (see the module)."""

    rows: Batch
    graph: Graph
    chunks: int
    seed: int
    _joins: tuple[Join, ...] = field(default=(), init=False)

    @property
    def covers(self) -> frozenset[str]:
        section = streamed_section(self.graph)
        assert section is not None
        generate, followers = section
        return frozenset([generate.name, *(node.name for node in followers)])

    def next(self, finished: list[Batch]) -> list[Partition]:
        if finished:
            return []
        samples = self.graph.samples_per_prompt
        per_chunk = -(-(len(self.rows) // samples) // self.chunks) * samples
        nodes = tuple(name for name in self.graph.order if name in self.covers)
        # Queued in order on the rollout: chunk 0 finishes first.
        return [Partition(rows=self.rows.slice(start, min(start + per_chunk, len(self.rows))), nodes=nodes,
                          seed=self.seed, generate_seed=self.seed + index * CHUNK_SEED_STRIDE, part=index)
                for index, start in enumerate(range(0, len(self.rows), per_chunk))]

    def join(self, finished: list[Batch]) -> Batch:
        produced = set(finished[0].tensors) - set(self.rows.tensors)
        width = _width(finished)
        pads = [_pads(state, width, produced) for state in finished]
        joined = Batch.concat([_padded(state, width, produced, pad) for state, pad in zip(finished, pads, strict=True)])
        self._joins = tuple(Join(name, len(finished), int(value.shape[1]) if value.dim() >= 2 else None,
                                 tuple(float(pad.get(name, 0)) for pad in pads))
                            for name, value in joined.tensors.items())
        return joined

    def joins(self) -> tuple[Join, ...]:
        return self._joins

    def close(self) -> None:
        return None


def _width(states: list[Batch]) -> int:
    return max(int(state["responses"].shape[1]) for state in states)


def _pads(state: Batch, width: int, produced: set[str]) -> dict[str, int]:
    """The value each response-aligned field the section ``produced`` is right-padded with up to ``width``
    (zeros; responses their own padding token); none when the chunk's responses are that wide already."""
    own = int(state["responses"].shape[1])
    if own == width:
        return {}
    off = state["response_mask"] == 0
    token = int(state["responses"][off][0]) if bool(off.any()) else 0
    return {name: token if name == "responses" else 0 for name, value in state.tensors.items()
            if name in produced and value.dim() >= 2 and value.shape[1] == own}


def _padded(state: Batch, width: int, produced: set[str], pads: dict[str, int]) -> Batch:
    """``state`` with the fields in ``pads`` right-padded to ``width``."""
    if not pads:
        return state
    tensors = {name: right_pad(value, width, pads[name]) if name in pads else value
               for name, value in state.tensors.items()}
    return Batch(tensors, state.non_tensors)
