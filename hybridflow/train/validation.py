"""A validation pass: the policy's completions for held-out prompts, scored by the run's reward functions.

Runs between steps on the policy's generate node (same sampling options as training, one sample per
prompt, a fixed seed so passes differ only by the weights). Nothing is trained and the step's data
ledger is untouched: the rows go to the workers as a standalone request. A graph with an LLM judge also records
the judge's verdicts on each training step's first samples (:func:`judged_samples`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.data import RewardScorer, batch_samples, encode_prompts
from hybridflow.data.records import Record
from hybridflow.graph import Graph, Node, Op
from hybridflow.graph.agents import env_reward_weight


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """The ``validation`` section (its prompts come from ``data.val_path`` or ``data.val_fraction``).
    ``every``: > 0 runs a pass every N steps and after the last; ``samples``: completions per pass kept in the
    samples table; ``before_train``: a pass before the first step, logged on step 0's line."""

    every: int = 0
    samples: int = 8
    before_train: bool = False

    def __post_init__(self) -> None:
        for name in ("every", "samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"config key 'validation.{name}'={getattr(self, name)} must be >= 0 (0: off)")


TABLE = "validation_samples"  # RUN_DIR/validation_samples.jsonl and the trackers' table name


@dataclass(frozen=True, kw_only=True)
class ValidationResult:
    """``val/...`` metrics and the first completions as table rows (prompt, response, ground truth, reward, and
    for a multi-turn rollout the whole ``trajectory``: turns, tool calls and the transcript)."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]]


def generate_node(graph: Graph) -> Node:
    """The policy's sampling node (the first generate node in graph order; ReMax's greedy one comes later)."""
    for name in graph.order:
        node = graph.node(name)
        if node.op is Op.GENERATE:
            return node
    raise ValueError(f"the {graph.name} graph has no generate node to validate with")


def validate(controller: Any, graph: Graph, records: Sequence[Record], *, tokenizer: Any, scorer: RewardScorer,
             seed: int, batch_size: int, table_rows: int = 8) -> ValidationResult:
    """Generate once per validation prompt, score with ``scorer``; mean/std reward and response length, overall
    (``val/reward/mean``...) and per data source (``val/<data_source>/reward/mean``... for rows with a
    ``data_source`` column), each reward function's mean when there are several."""
    node = generate_node(graph)
    rewards: list[float] = []
    lengths: list[float] = []
    parts: dict[str, list[float | None]] = {}
    rows: list[dict[str, Any]] = []
    sources: list[str | None] = []
    for start in range(0, len(records), batch_size):
        prompts = encode_prompts(records[start:start + batch_size], tokenizer)
        generated = controller.generate(node.name, prompts, seed=seed)
        samples = batch_samples(generated, tokenizer)
        sources += [sample.data_source for sample in samples]
        total, by_function = scorer.score(samples, track=False)
        traces = list(generated["agent_trace"]) if node.environment else [None] * len(samples)
        if node.environment:  # the environment's rewards count as in training
            weight = env_reward_weight(graph)
            total = [score + weight * float(env) for score, env in zip(total, generated["env_rewards"], strict=True)]
        rewards += total
        lengths += [float(len(sample.response_ids or [])) for sample in samples]
        for name, values in by_function.items():
            parts.setdefault(name, []).extend(values)
        rows += [{"prompt": sample.prompt_text, "response": sample.response, "ground_truth": sample.ground_truth,
                  "reward": reward, **({"data_source": sample.data_source} if sample.data_source else {}),
                  **({"rewards": {name: values[i] for name, values in by_function.items()}}
                     if len(by_function) > 1 else {}),
                  **({"trajectory": json.loads(trace)} if trace else {})}
                 for i, (sample, reward, trace) in enumerate(zip(samples, total, traces, strict=True))]
    metrics = _summary("val", rewards, lengths)
    if len(parts) > 1:  # several weighted functions: each one's own mean too (over the samples it scored)
        metrics.update({f"val/reward/{name}/mean": statistics.fmean(answered) for name, values in parts.items()
                        if (answered := [v for v in values if v is not None])})
    for source in sorted({source for source in sources if source}):  # verl's per-source validation metrics
        chosen = [i for i, s in enumerate(sources) if s == source]
        metrics.update(_summary(f"val/{source}", [rewards[i] for i in chosen], [lengths[i] for i in chosen]))
    return ValidationResult(metrics=metrics, samples=rows[:table_rows])


def _summary(prefix: str, rewards: list[float], lengths: list[float]) -> dict[str, float]:
    return {f"{prefix}/reward/mean": statistics.fmean(rewards),
            f"{prefix}/reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            f"{prefix}/response_length/mean": statistics.fmean(lengths), f"{prefix}/prompts": float(len(rewards))}


JUDGE_TABLE = "judge_samples"  # RUN_DIR/judge_samples.jsonl: a judge's verdicts on the step's samples
VERDICTS = "verdicts"  # the field an LLM judge's parse node writes (hybridflow.algorithms.judge)


def judged_samples(batch: Any, tokenizer: Any, rows: int) -> list[dict[str, Any]]:
    """The first ``rows`` training samples of a step whose graph has an LLM judge: prompt, response, ground truth,
    the judge's verdict and the score it parsed to ([] when the step's rows hold no ``verdicts``)."""
    if VERDICTS not in batch or not rows:
        return []
    head = batch.slice(0, min(rows, len(batch)))
    samples = batch_samples(head, tokenizer)
    return [{"prompt": sample.prompt_text, "response": sample.response, "ground_truth": sample.ground_truth,
             "verdict": str(verdict), "score": float(score)}
            for sample, verdict, score in zip(samples, head[VERDICTS], head["scores"].tolist(), strict=True)]
