"""Per-step metrics: derived from the step's batch, written to ``metrics.jsonl`` and the configured trackers."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.agents.metrics import agent_metrics
from hybridflow.graph import Graph, Op
from hybridflow.runtime.controller import StepResult
from hybridflow.train.trackers import Table, Tracker, make_trackers


def step_metrics(result: StepResult, seconds: float, graph: Graph | None = None) -> dict[str, float]:
    """Reward mean/std, KL (``teacher_kl``: the sampled reverse KL to a distillation teacher), entropy, clip
    fraction, response length, token counts, per-node time, tokens/s, memory.

    What describes the sequences (``response_length/*``, ``throughput/*``, ``tokens/response``) counts
    ``response_mask``; what describes training (``kl``, ``tokens/trained``) counts the loss mask, ``loss_mask``
    where the rollout wrote one (a multi-turn rollout's tool outputs are in the first, not the second).
    """
    batch, out = result.batch, dict(result.metrics)
    if "scores" in batch:
        scores = batch["scores"].float()
        out["reward/mean"], out["reward/std"] = float(scores.mean()), float(scores.std()) if len(scores) > 1 else 0.0
    mask = batch["response_mask"].float() if "response_mask" in batch else None
    if mask is not None:
        trained = batch["loss_mask"].float() if "loss_mask" in batch else mask
        out["response_length/mean"] = float(mask.sum(dim=1).mean())
        out["response_length/max"] = float(mask.sum(dim=1).max())
        out["throughput/tokens_per_s"] = float(mask.sum()) / max(seconds, 1e-9)
        out["tokens/response"] = float(mask.sum())
        out["tokens/trained"] = float(trained.sum())
        out["tokens/trained_fraction"] = float(trained.sum() / mask.sum().clamp(min=1))
        if "old_logprobs" in batch and "ref_logprobs" in batch:
            kl = torch.where(trained != 0, batch["old_logprobs"] - batch["ref_logprobs"], 0.0)
            out["kl"] = float(kl.sum() / trained.sum().clamp(min=1))
        elif "ref_logprobs" in batch:  # old log-probs taken inside a single-pass update: its own k1 to the reference
            own = [value for key, value in result.metrics.items() if key.endswith("/ref_kl")]
            if own:
                out["kl"] = float(own[0])
        if "old_logprobs" in batch and "teacher_logprobs" in batch:  # on-policy distillation's reverse KL, k1
            gap = torch.where(trained != 0, batch["old_logprobs"] - batch["teacher_logprobs"], 0.0)
            out["teacher_kl"] = float(gap.sum() / trained.sum().clamp(min=1))
    if "agent_trace" in batch:
        out.update(agent_metrics(list(batch["agent_trace"])))
    out.update({f"time/{name}": value for name, value in result.node_seconds.items()})
    for name, (start, end) in result.node_spans.items():  # the step's timeline (the plan's node start_s, end_s)
        out[f"timeline/{name}/start_s"], out[f"timeline/{name}/end_s"] = start, end
    out["time/step"] = seconds
    out["memory/rss_gb"] = _rss_gb()
    if graph is not None:
        out.update(_node_throughput(result, graph))
    out.update(_gpu_metrics())
    return out


CONSOLE_KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm",
                "actor/lr", "critic/vf_loss", "response_length/mean", "val/reward/mean", "time/step")
"""What a console metric line shows, in order, when the step has it (TRL's and verl's usual columns)."""


def console_line(step: int, steps: int, metrics: Mapping[str, float]) -> str:
    """``step 3/10 | reward/mean 0.512 | ...``: one line of a step's key metrics, and each ``reward/<fn>/mean``."""
    keys = [*CONSOLE_KEYS[:2], *sorted(k for k in metrics if k.startswith("reward/") and k.endswith("/mean")
                                       and k != "reward/mean"), *CONSOLE_KEYS[2:]]
    shown = [f"{key} {metrics[key]:.4g}" for key in keys if key in metrics]
    return " | ".join([f"step {step + 1}/{steps}", *shown])


def _node_throughput(result: StepResult, graph: Graph) -> dict[str, float]:
    """Tokens per second of each role node: decoded tokens for rollout, whole sequences otherwise."""
    batch, out = result.batch, dict[str, float]()
    if "response_mask" not in batch:
        return out
    responses = float(batch["response_mask"].sum())
    prompts = float(batch["prompt_mask"].sum()) if "prompt_mask" in batch else 0.0
    for node in graph.nodes:
        seconds = result.node_seconds.get(node.name, 0.0)
        if node.role is None or seconds <= 0:
            continue
        tokens = responses if node.op is Op.GENERATE else responses + prompts
        out[f"throughput/{node.name}_tokens_per_s"] = tokens / seconds
    return out


def _gpu_metrics() -> dict[str, float]:
    """Memory (torch.cuda) and utilisation (NVML, when installed) of this process's GPUs; empty on CPU."""
    if not torch.cuda.is_available():
        return {}
    out = {"gpu/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30}
    try:
        import pynvml
    except ImportError:  # utilisation needs the nvidia-ml-py package; memory above does not
        return out
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    out["gpu/utilization_pct"] = sum(pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles) / len(handles)
    return out


def _rss_gb() -> float:
    import psutil

    process = psutil.Process()
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:  # a child may exit while we look
            continue
    return total / 2**30


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl`` and logs to the trackers; on resume drops lines past
    the checkpoint. Tables (validation samples) go to ``RUN_DIR/<name>.jsonl`` and the trackers."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None,
                 trackers: Sequence[str] = ("tensorboard",), name: str = "hybridflow",
                 config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] < resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.resume_step = resume_step
        self.trackers: list[Tracker] = make_trackers(list(trackers), run_dir, name=name, config=config or {})

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def write_table(self, step: int, name: str, rows: Table) -> Path:
        """Rows (e.g. prompt, response, reward) appended to ``RUN_DIR/<name>.jsonl`` with their step."""
        path = self.run_dir / f"{name}.jsonl"
        with path.open("a") as handle:
            for row in rows:
                handle.write(json.dumps({"step": step, **row}) + "\n")
        for tracker in self.trackers:
            tracker.log_table(step, name, rows)
        return path

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics.jsonl (a torn last line skipped with a warning; garbage refused naming the line)."""
    from hybridflow.monitor.report import read_metrics_file

    return read_metrics_file(path)
