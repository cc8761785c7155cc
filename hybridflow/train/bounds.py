"""Upper bounds on a run's size-like config keys, checked before anything is read or allocated.

One table (:func:`size_bounds`), one check (:func:`check_size`). Each bound stands for something: the host
memory a value would fill, the model's own size (a response longer than its context, a LoRA rank above the
width it adapts), or the step's row bound that every tensor of a step is sized by. Keys that size nothing up
front (``steps``, token budgets, which cap what a step's rows already bound) have none. docs/configuration.md,
"Limits".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph, Op
from hybridflow.planner.settings import MAX_SEQUENCE_TOKENS, MAX_STEP_ROWS
from hybridflow.train.config import TrainConfig
from hybridflow.train.file_checks import model_config

ROW_BYTES = 1024  # host memory a generated prompt holds through data preparation (measured ~500 B; 2x margin)
WEIGHT_BYTES = 2  # bf16, the smallest dtype a role loads weights in


@dataclass(frozen=True)
class SizeBound:
    """A size-like key's value, the most it may be, why, and what to do instead (None: the key is unused)."""

    key: str
    value: int | None
    high: int
    why: str
    fix: str


def check_size(bound: SizeBound) -> None:
    """Raise ``ValueError`` naming the key, its value, the bound, why and the fix."""
    if bound.value is not None and bound.value > bound.high:
        raise ValueError(f"config key {bound.key!r}={bound.value} exceeds {bound.high}: {bound.why}; {bound.fix}")


def check_sizes(config: TrainConfig, graph: Graph) -> None:
    """Every bound of :func:`size_bounds`, and the weights of each model directory against host memory."""
    for bound in size_bounds(config, graph):
        check_size(bound)
    for key, path in _model_dirs(config):
        check_model_size(key, path)


def size_bounds(config: TrainConfig, graph: Graph) -> list[SizeBound]:
    """The bounds of ``config``'s size-like keys (those in use), in the order a reader finds them."""
    memory = host_memory_bytes()
    context = _shape(config, None).get("max_position_embeddings")
    rows_why = f"a pass holds at most a step's rows, and a step at most {MAX_STEP_ROWS} (its tensors are sized by them)"
    generates = any(node.op is Op.GENERATE for node in graph.nodes)
    response_high = context - 1 if isinstance(context, int) and context > 1 else MAX_SEQUENCE_TOKENS
    response_why = (f"the model's context (max_position_embeddings={context}) holds the prompt and the response"
                    if response_high != MAX_SEQUENCE_TOKENS else "responses are sized in tokens up front")
    bounds = [
        SizeBound("data.num_examples", None if config.data.path else config.data.num_examples, memory // ROW_BYTES,
                  f"each generated prompt holds about {ROW_BYTES} bytes of host memory through data preparation and "
                  f"this machine has {_gib(memory)}", "lower it (the built-in tasks train on a few thousand), or give "
                  "prompts as files (data.path)"),
        SizeBound("model.sft_batch_size", None if config.model.path else config.model.sft_batch_size, MAX_STEP_ROWS,
                  rows_why, "lower it (32 warms a tiny model)"),
        SizeBound("algorithm.options.max_new_tokens", graph.max_new_tokens if generates else None, response_high,
                  response_why, "lower it"),
        SizeBound("data.max_prompt_length", config.data.max_prompt_length, MAX_SEQUENCE_TOKENS,
                  "longer than any model's context", "lower it to the model's context less max_new_tokens"),
        SizeBound("agent.max_turn_tokens", config.agent.max_turn_tokens, response_high, response_why,
                  "lower it (at most max_new_tokens is sampled in all turns together)"),
        SizeBound("pipeline.segment_tokens", config.pipeline.segment_tokens or None, response_high, response_why,
                  "lower it (0: a quarter of max_new_tokens)"),
    ]
    for name, optim in (("optim.actor", config.optim.actor), ("optim.critic", config.optim.critic)):
        bounds.append(SizeBound(f"{name}.micro_batch_size", optim.micro_batch_size, MAX_STEP_ROWS, rows_why,
                                "lower it"))
    for role, entry in config.roles.items():
        bounds.append(SizeBound(f"roles.{role}.micro_batch_size", entry.micro_batch_size, MAX_STEP_ROWS, rows_why,
                                "lower it"))
        width = _shape(config, entry.model).get("hidden_size")
        if entry.lora is not None and isinstance(width, int) and width > 0:
            bounds.append(SizeBound(f"roles.{role}.lora.rank", entry.lora.rank, width,
                                    f"every weight it adapts has a side of at most the model's hidden_size={width}, "
                                    "so a larger rank is beyond full rank (it only costs memory)",
                                    "use a rank well below it (LoRA recipes use 8-64)"))
    return bounds


def check_model_size(key: str, path: str) -> None:
    """A model directory's ``config.json`` sizes are positive integers and its weights fit the host's memory,
    which they pass through as they load; the error names the file and the key in it."""
    from hybridflow.planner.models import from_config_dict

    file = Path(path).expanduser() / "config.json"
    found = model_config(key, file.parent)
    sizes: dict[str, Any] = found["text_config"] if isinstance(found.get("text_config"), dict) else found
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "max_position_embeddings"):
        value = sizes.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config key {key!r}: {file} has {name}={value!r}, which must be a positive integer; "
                             "restore the file from the model's source")
    try:
        params = from_config_dict(sizes, name=path).params
    except (ValueError, TypeError, KeyError, ZeroDivisionError):  # a shape the planner cannot count: nothing to bound
        return
    memory, weights = host_memory_bytes(), params * WEIGHT_BYTES
    if weights > memory:
        raise ValueError(f"config key {key!r}: {file} describes about {params:.3g} weights ({_gib(weights)} in "
                         f"bf16), more than this machine's {_gib(memory)} of memory, through which they load; "
                         "check hidden_size, num_hidden_layers and vocab_size there")


def host_memory_bytes() -> int:
    """This machine's memory, or its cgroup's limit when lower (a container's)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _model_dirs(config: TrainConfig) -> list[tuple[str, str]]:
    named = [("model.path", config.model.path)] + [(f"roles.{role}.model", entry.model)
                                                   for role, entry in config.roles.items()]
    return [(key, path) for key, path in named if path]


def _shape(config: TrainConfig, role_model: str | None) -> dict[str, Any]:
    """The size keys of a role's model (``role_model``, else the policy's): its config.json (a multimodal one's
    ``text_config``), or the tiny config; empty when unreadable (check_model_paths names such a file)."""
    from hybridflow.models.tiny import TINY_CONFIGS

    path = role_model or config.model.path
    if path is None:
        return dict(TINY_CONFIGS.get(config.model.name, ("", {}))[1])
    file = Path(path).expanduser() / "config.json"
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return found["text_config"] if isinstance(found.get("text_config"), dict) else found


def _gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"
