"""Streaming within a step: the rows of a generate node flow on in chunks as they finish.

With ``stream_chunks=m`` the controller splits a step's prompts into m chunks (a prompt's n samples stay
together) and generates them one after another on the rollout. When a chunk's responses are done, the
row-wise forward nodes that read them (scores, reference / actor log-probs, values) start on that chunk
at once, on their own groups or on the driver, while the next chunk still decodes: a reward function, a
reference on other GPUs, an LLM judge on its own group (its prompts, generate and verdicts: a second generate
that answers each sampled row once, :mod:`hybridflow.graph.streamed`) or a trainer pool beside a detached
rollout no longer waits for the slowest response of the whole batch. Nodes that need the whole batch
(advantages, filters, updates) run after the last chunk, on the chunks' outputs joined in row order
(response-aligned fields right-padded to the batch's longest response; a judge's computed prompts left-padded,
its verdicts right-padded, each to its widest). Chunk ``i`` samples with the step's seed plus ``i`` x
1,000,003: a streamed run is reproducible, but its samples differ from an unchunked run's (greedy decoding
gives the same ones).
Streaming applies to ``sync`` steps; ``one_step_off`` and ``async`` already take generation off the
step's critical path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.graph import Graph, Node, Op
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.scheduler import Partition
from hybridflow.runtime.step_store import Join, left_pad, right_pad

CHUNK_SEED_STRIDE = 1_000_003


def streamed_section(graph: Graph) -> tuple[Node, list[Node]] | None:
    """The generate node a step can stream from and the row-wise nodes that follow it chunk by chunk
    (``Graph.streamed_followers``, the rule the planner costs too); None when the graph has no sampling generate
    to stream from (``Graph.stream_generate``: a filter's rounds regenerate; a second generate must answer the
    sampled rows one by one, as an LLM judge's does)."""
    generate = graph.stream_generate
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
        aligned = _alignments(self.graph)
        widths = {field: max(int(state[field].shape[1]) for state in finished) for field, _, _ in aligned
                  if field in finished[0].tensors}
        pads = [_pads(state, widths, produced, aligned) for state in finished]
        joined = Batch.concat([_padded(state, pad) for state, pad in zip(finished, pads, strict=True)])
        left = {name for pad in pads for name, (_, _, on_left) in pad.items() if on_left}
        self._joins = tuple(Join(name, len(finished), int(value.shape[1]) if value.dim() >= 2 else None,
                                 tuple(float(pad[name][1]) if name in pad else 0.0 for pad in pads),
                                 left=name in left)
                            for name, value in joined.tensors.items())
        return joined

    def joins(self) -> tuple[Join, ...]:
        return self._joins

    def close(self) -> None:
        return None


Pads = dict[str, tuple[int, float, bool]]
"""Field -> (width, pad value, whether on the left) for one chunk's fields that are narrower than the join's."""


def _alignments(graph: Graph) -> list[tuple[str, str, bool]]:
    """(ids field, its mask, left-padded?) of each token axis of the streamed section: the sampled responses, and
    each following generate's computed prompts (left-padded) and answers (an LLM judge's prompts and verdicts)."""
    aligned = [("responses", "response_mask", False)]
    for name in graph.streamed_followers:
        node = graph.node(name)
        if node.op is Op.GENERATE:
            prompts, answers = node.port_inputs()["prompts"], node.port_outputs()
            aligned += [(prompts, f"{prompts}_mask", True), (answers["responses"], answers["response_mask"], False)]
    return aligned


def _pads(state: Batch, widths: dict[str, int], produced: set[str], aligned: list[tuple[str, str, bool]]) -> Pads:
    """How each token-aligned field the section ``produced`` is padded up to the joined width: its axis's ids with
    their own padding token (a masked-off one of the chunk; 0 when none is), every other field with zeros. A field
    no axis names lies along the responses when it is as wide (log-probs, values)."""
    axis_of = {name: (ids, mask, left) for ids, mask, left in aligned[1:] for name in (ids, mask)}
    own = int(state["responses"].shape[1])
    pads: Pads = {}
    for name in produced:
        value = state[name]
        if value.dim() < 2:
            continue
        ids, mask, left = axis_of.get(name, aligned[0] if value.shape[1] == own else ("", "", False))
        width = widths.get(ids, 0)
        if not ids or value.shape[1] == width:
            continue
        off = state[mask] == 0
        token = int(state[ids][off][0]) if name == ids and bool(off.any()) else 0
        pads[name] = (width, token, left)
    return pads


def _padded(state: Batch, pads: Pads) -> Batch:
    """``state`` with the fields in ``pads`` padded to their width, on their side."""
    if not pads:
        return state
    tensors = {name: _pad(value, *pads[name]) if name in pads else value for name, value in state.tensors.items()}
    return Batch(tensors, state.non_tensors)


def _pad(value: torch.Tensor, width: int, pad: float, left: bool) -> torch.Tensor:
    return left_pad(value, width, pad) if left else right_pad(value, width, pad)
