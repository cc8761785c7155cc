"""The tokens a judge's template adds to each judge prompt, counted with the run's tokenizer for the planner.

A generate whose prompts a compute node renders from the sampled rows (an LLM judge's) reads the policy's prompt
and response wrapped in the template's own text (and, for a reference-guided template, the row's ground truth).
The planner prices that prompt as prompt + response + these tokens (``Workload.template_tokens``); a dry run
without the run's tokenizer takes the rendering node's estimate instead (``graph.TEMPLATE_TOKENS_OPTION``). The
count is the rendering function's own (its ``template_tokens`` attribute, see ``runtime.protocols.NodeState``), in
the tokenizer of the role that answers: ``roles.<name>.model``'s, else the policy's (a judge without a model of its
own is a frozen copy of the policy's starting weights, saved with its tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.data.records import GROUND_TRUTH
from hybridflow.graph import Graph, Op
from hybridflow.graph.streamed import computes_prompts
from hybridflow.models.tokenizer import char_tokenizer, load_tokenizer
from hybridflow.registry import COMPUTE_FNS
from hybridflow.train.config import TrainConfig

SAMPLED_ROWS = 256  # ground truths a reference-guided template's count averages over (the data's first rows)


def template_tokens(config: TrainConfig, graph: Graph, tokenizer: Any, records: Sequence[Any]) -> int | None:
    """The most tokens any of ``graph``'s rendered prompts adds around a prompt and response (see the module); None
    when no node renders prompts or none says how many its rendering adds. ``tokenizer``: the policy's."""
    counts = []
    for node in graph.nodes:
        if node.op is not Op.GENERATE or not computes_prompts(graph, node):
            continue
        renderer = graph.node(graph.producers[node.port_inputs()["prompts"]])
        count = getattr(COMPUTE_FNS.get(str(renderer.fn)), "template_tokens", None)
        if count is None:
            continue
        truths = [str(record.get(GROUND_TRUTH, "")) for record in records[:SAMPLED_ROWS]]
        counts.append(int(count(tokenizer=_role_tokenizer(config, str(node.role), tokenizer), ground_truths=truths,
                                **renderer.options_dict)))
    return max(counts) if counts else None


def _role_tokenizer(config: TrainConfig, role: str, policy: Any) -> Any:
    """The tokenizer ``role`` answers in: its own model's (a built-in tiny model's character tokenizer for a name),
    else the policy's."""
    entry = config.roles.get(role)
    model = getattr(entry, "model", None)
    if not model:
        return policy
    return load_tokenizer(model) if Path(model).expanduser().is_dir() else char_tokenizer()
