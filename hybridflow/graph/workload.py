"""How much work each node does and how many bytes each edge carries, for one training step."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.graph.fields import Extent, field_spec
from hybridflow.graph.graph import Graph
from hybridflow.graph.node import Node
from hybridflow.graph.roles import Op

# The option a compute node that renders another generate's prompts (an LLM judge's ``judge_prompts``) carries: the
# tokens its rendering adds around the prompt and response it reads, as its algorithm estimates them from the text
# alone (a dry run's count; a run counts them with its tokenizer, ``Workload.template_tokens``).
TEMPLATE_TOKENS_OPTION = "template_tokens"


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """One step's data: ``batch_size`` prompts, each answered ``n_samples`` times.

    ``n_samples`` overrides the graph's own ``n`` when given. ``token_bytes``/``float_bytes`` size
    token ids and per-token statistics on the wire. ``filter_keep_rate`` is the expected fraction of
    prompt groups a graph's filter keeps (DAPO: the groups whose rewards differ; 1: all of them).
    ``image_tokens``: visual tokens of a prompt's image beside its ``prompt_len`` text tokens (a vision-language
    model's language model reads each as one prompt position; 0: a text-only workload).
    ``template_tokens``: the tokens a rendered prompt adds around the prompt and response it reads (an LLM judge's
    template and chat markup, and the ground truth a reference-guided template shows), counted with the run's
    tokenizer; None: each rendering node's own estimate (its :data:`TEMPLATE_TOKENS_OPTION`, 0 without one).
    """

    batch_size: int
    prompt_len: int
    response_len: int
    n_samples: int | None = None
    token_bytes: int = 8
    float_bytes: int = 4
    filter_keep_rate: float = 1.0
    image_tokens: int = 0
    template_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "prompt_len", "response_len", "token_bytes", "float_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Workload.{name}={value!r} must be a positive integer")
        if not isinstance(self.image_tokens, int) or isinstance(self.image_tokens, bool) or self.image_tokens < 0:
            raise ValueError(f"Workload.image_tokens={self.image_tokens!r} must be an integer >= 0 (visual tokens a "
                             "prompt's image holds; 0 for text)")
        extra = self.template_tokens
        if extra is not None and (not isinstance(extra, int) or isinstance(extra, bool) or extra < 0):
            raise ValueError(f"Workload.template_tokens={extra!r} must be an integer >= 0 (tokens a judge's template "
                             "adds to each judge prompt) or None (the graph's own estimate)")
        n = self.n_samples
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
            raise ValueError(f"Workload.n_samples={self.n_samples!r} must be a positive integer or None")
        if not 0 < self.filter_keep_rate <= 1:
            raise ValueError(f"Workload.filter_keep_rate={self.filter_keep_rate!r} must be in (0, 1]")

    def rounds(self, graph: Graph) -> float:
        """Expected rollout rounds per step: a filter keeping a fraction ``p`` of the groups needs ``1 / p``
        rounds to refill the batch (the fluid limit), at most its ``max_rounds`` extra ones."""
        node = graph.filter_node
        if node is None:
            return 1.0
        return min(1.0 + int(node.option("max_rounds", 0) or 0), 1.0 / self.filter_keep_rate)

    def samples(self, graph: Graph) -> int:
        return self.n_samples or graph.samples_per_prompt

    def sequences(self, graph: Graph) -> int:
        """Rows after rollout: every prompt times its samples."""
        return self.batch_size * self.samples(graph)


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """Token counts of one node for one step.

    ``prompt_tokens`` are prefilled (or re-read by a forward pass), ``response_tokens`` decoded by a
    generate node or scored/trained by every other role op. Compute nodes process no model tokens.
    ``image_tokens`` are the visual tokens among ``prompt_tokens`` (counted as they are: once per shared
    prompt in a rollout) and ``row_image_tokens`` those of one sequence's context.
    """

    node: str
    op: Op
    sequences: int
    prompt_tokens: int
    response_tokens: int
    image_tokens: int = 0
    row_image_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def text_only(self) -> NodeLoad:
        """This load as a model without a vision tower reads it: the images' tokens left out of the prompt."""
        if not self.image_tokens:
            return self
        return NodeLoad(self.node, self.op, self.sequences, self.prompt_tokens - self.image_tokens,
                        self.response_tokens)


def node_load(graph: Graph, node: Node, workload: Workload) -> NodeLoad:
    """Tokens ``node`` processes in one step; a filter's section counts every expected round."""
    load = _one_round(graph, node, workload)
    if node.name not in graph.sampling_section:
        return load
    rounds = workload.rounds(graph)
    return NodeLoad(node.name, node.op, round(load.sequences * rounds), round(load.prompt_tokens * rounds),
                    round(load.response_tokens * rounds), round(load.image_tokens * rounds), load.row_image_tokens)


def _one_round(graph: Graph, node: Node, workload: Workload) -> NodeLoad:
    rows = workload.sequences(graph)
    image = workload.image_tokens
    prompt = workload.prompt_len + image  # what a vision-language model's LM reads (NodeLoad.text_only: the rest)
    if node.op in (Op.COMPUTE, Op.FILTER):
        return NodeLoad(node.name, node.op, rows, 0, 0)
    if node.op is Op.GENERATE and node.port_inputs()["prompts"] in graph.producers:
        # Prompts a node renders from the sampled rows (an LLM judge's: prompt + response + template): each row is
        # prefilled alone and answered once, within the node's own budget (a verdict's few tokens).
        rendered = prompt + workload.response_len + template_tokens(graph, node, workload)
        return NodeLoad(node.name, node.op, rows, rows * rendered, rows * node.max_new_tokens, rows * image, image)
    if node.op is Op.GENERATE:
        # Prompts are prefilled once and shared by their n samples (prefix caching in vLLM; one encode an image).
        return NodeLoad(node.name, node.op, rows, workload.batch_size * prompt, rows * workload.response_len,
                        workload.batch_size * image, image)
    return NodeLoad(node.name, node.op, rows, rows * prompt, rows * workload.response_len, rows * image, image)


def template_tokens(graph: Graph, node: Node, workload: Workload) -> int:
    """The tokens the node rendering generate ``node``'s prompts adds to each: the workload's count where the run
    measured one, else the rendering node's own estimate (:data:`TEMPLATE_TOKENS_OPTION`), else 0."""
    if workload.template_tokens is not None:
        return workload.template_tokens
    renderer = graph.node(graph.producers[node.port_inputs()["prompts"]])
    return int(renderer.option(TEMPLATE_TOKENS_OPTION, 0) or 0)


def node_loads(graph: Graph, workload: Workload) -> dict[str, NodeLoad]:
    """Per node of ``graph``, the tokens it processes for ``workload``."""
    return {node.name: node_load(graph, node, workload) for node in graph.nodes}


def field_bytes(graph: Graph, name: str, workload: Workload) -> int:
    """Bytes of one field for the whole step (graph inputs count once per prompt)."""
    spec = field_spec(name)
    rows = workload.batch_size if name in graph.inputs else workload.sequences(graph)
    per_row = {
        Extent.SEQUENCE: 1,
        Extent.PROMPT_TOKENS: workload.prompt_len + workload.image_tokens,  # an image's placeholder ids too
        Extent.RESPONSE_TOKENS: workload.response_len,
    }[spec.extent]
    return rows * per_row * spec.dtype_bytes


def edge_bytes(graph: Graph, workload: Workload) -> dict[tuple[str, str], int]:
    """(src, dst) -> bytes that ``dst`` reads from ``src`` in one step."""
    rounds = workload.rounds(graph)
    return {
        # Data leaving a filter's section crosses every round (what the section keeps reading, too).
        (edge.src, edge.dst): round(sum(field_bytes(graph, name, workload) for name in edge.fields)
                                    * (rounds if edge.src in graph.sampling_section else 1.0))
        for edge in graph.edges
    }
