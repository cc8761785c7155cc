"""Which metrics go on which plot: panels chosen from the keys a run's ``metrics.jsonl`` holds.

Keys follow :mod:`hybridflow.train.metrics` and the losses: step-level ``reward/mean``,
``reward/std``, ``kl``, ``response_length/{mean,max}``, ``time/<node>``, ``throughput/<node>_tokens_per_s``,
``memory/rss_gb``, ``gpu/*``, ``agent/*`` (multi-turn rollouts), ``timeline/<node>/{start_s,end_s}`` (one
step's node spans: :func:`choose_timeline`); per role ``<role>/loss``, ``pg_loss``,
``vf_loss``, ``kl``, ``kl_loss``, ``approx_kl``, ``entropy``, ``clipfrac``, ``clipfrac_lower``, ``vf_clipfrac``,
``grad_norm``, ``lr``.
No plotting here, so the choice is testable without matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Rows = Sequence[Mapping[str, object]]
Scale = Literal["linear", "log", "from_zero", "fraction", "percent"]


@dataclass(frozen=True, kw_only=True)
class Series:
    """One line: its label and the (step, value) points that have a finite value."""

    key: str
    label: str
    steps: tuple[float, ...]
    values: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class Panel:
    """One plot: file name, title, y-axis label and scale, its lines and (for the reward) a ±std band."""

    filename: str
    title: str
    ylabel: str
    scale: Scale
    series: tuple[Series, ...]
    band: Series | None = None  # the spread drawn around the first series (mean ± band)
    smooth: bool = False  # add a rolling mean of the first series (long runs only; see plots.py)


@dataclass(frozen=True, kw_only=True)
class _Spec:
    filename: str
    title: str
    ylabel: str
    scale: Scale
    match: Callable[[str], bool]
    label: Callable[[str], str] = str


def _role_metric(*names: str) -> Callable[[str], bool]:
    """Per-role metrics ``<role>/<name>`` (the controller prefixes each update node's metrics with its role)."""
    return lambda key: key.count("/") == 1 and key.split("/")[1] in names


SPECS = (
    _Spec(filename="kl.png", title="KL to the reference policy", ylabel="KL (nats / token)", scale="linear",
          match=lambda k: k == "kl" or _role_metric("kl", "kl_loss", "approx_kl")(k)),
    _Spec(filename="entropy.png", title="Policy entropy", ylabel="nats / token", scale="linear",
          match=_role_metric("entropy")),
    _Spec(filename="clip_fraction.png", title="Clip fraction", ylabel="fraction of tokens clipped", scale="fraction",
          match=_role_metric("clipfrac", "clipfrac_lower", "vf_clipfrac")),
    _Spec(filename="grad_norm.png", title="Gradient norm (before clipping)", ylabel="L2 norm", scale="linear",
          match=_role_metric("grad_norm")),
    _Spec(filename="loss.png", title="Losses", ylabel="loss", scale="linear",
          match=_role_metric("loss", "pg_loss", "vf_loss")),
    _Spec(filename="response_length.png", title="Response length", ylabel="tokens", scale="from_zero",
          match=lambda k: k.startswith("response_length/")),
    _Spec(filename="learning_rate.png", title="Learning rate", ylabel="lr", scale="from_zero",
          match=_role_metric("lr")),
    _Spec(filename="throughput.png", title="Throughput per node (log scale)", ylabel="tokens / s", scale="log",
          match=lambda k: k.startswith("throughput/"),
          label=lambda k: "whole step" if k == "throughput/tokens_per_s"
          else k.removeprefix("throughput/").removesuffix("_tokens_per_s")),
    _Spec(filename="memory.png", title="Memory", ylabel="GiB", scale="from_zero",
          match=lambda k: k.startswith("memory/") or (k.startswith("gpu/") and k.endswith("_gb"))),
    _Spec(filename="gpu_utilization.png", title="GPU utilisation", ylabel="%", scale="percent",
          match=lambda k: k.startswith("gpu/") and k.endswith("_pct")),
    _Spec(filename="reward_cache.png", title="Reward cache hit rate", ylabel="hit rate", scale="fraction",
          match=lambda k: k == "reward_cache/hit_rate"),
    _Spec(filename="agent_turns.png", title="Agent trajectories", ylabel="per trajectory", scale="from_zero",
          match=lambda k: k in ("agent/turns_mean", "agent/turns_max", "agent/tool_calls_per_trajectory"),
          label=lambda k: k.removeprefix("agent/")),
    _Spec(filename="agent_tool_rates.png", title="Agent tool use", ylabel="fraction of trajectories",
          scale="fraction", match=lambda k: k in ("agent/tool_call_rate", "agent/truncated_fraction"),
          label=lambda k: k.removeprefix("agent/")),
    _Spec(filename="agent_tool_failures.png", title="Agent tool failures per step", ylabel="calls",
          scale="from_zero", match=lambda k: k in ("agent/tool_errors", "agent/tool_timeouts", "agent/parse_errors"),
          label=lambda k: k.removeprefix("agent/")),
    _Spec(filename="agent_tool_latency.png", title="Tool latency", ylabel="seconds", scale="from_zero",
          match=lambda k: k in ("agent/tool_latency_p50_s", "agent/tool_latency_p95_s"),
          label=lambda k: k.removeprefix("agent/tool_latency_").removesuffix("_s")),
    _Spec(filename="weight_sync.png", title="Weight sync to detached rollouts", ylabel="seconds", scale="from_zero",
          match=lambda k: k.endswith(("weight_sync/seconds", "weight_sync/planned_seconds"))),
)


def series(rows: Rows, key: str, label: str | None = None) -> Series:
    """The finite numeric values of ``key`` by step (missing, NaN and non-numeric entries skipped)."""
    points = [(float(_number(row.get("step", index))), float(_number(row[key]))) for index, row in enumerate(rows)
              if key in row and _finite(row[key])]
    return Series(key=key, label=label or key, steps=tuple(p[0] for p in points), values=tuple(p[1] for p in points))


def choose_panels(rows: Rows) -> list[Panel]:
    """The panels this run has data for, in reading order: reward, then training signals, then systems."""
    keys = sorted({key for row in rows for key in row if key != "step"})
    panels = [p for p in (_reward_panel(rows), _node_time_panel(rows, keys)) if p is not None]
    for spec in SPECS:
        lines = tuple(s for s in (series(rows, k, spec.label(k)) for k in keys if spec.match(k)) if s.values)
        if lines:
            panels.append(Panel(filename=spec.filename, title=spec.title, ylabel=spec.ylabel, scale=spec.scale,
                                series=lines))
    order = ("reward.png", "kl.png", "entropy.png", "clip_fraction.png", "grad_norm.png", "loss.png",
             "response_length.png", "node_time.png")
    return sorted(panels, key=lambda p: order.index(p.filename) if p.filename in order else len(order))


def _reward_panel(rows: Rows) -> Panel | None:
    mean = series(rows, "reward/mean", "mean reward")
    if not mean.values:
        return None
    lines = [mean]
    validation = series(rows, "val/reward/mean", "validation mean reward")
    if validation.values:
        lines.append(validation)
    std = series(rows, "reward/std", "± std over samples")
    return Panel(filename="reward.png", title="Reward (mean ± std over the step's samples)", ylabel="reward",
                 scale="linear", series=tuple(lines), band=std if std.values else None, smooth=True)


def _node_time_panel(rows: Rows, keys: Sequence[str]) -> Panel | None:
    nodes = [k for k in keys if k.startswith("time/") and k != "time/step"]
    lines = [series(rows, k, k.removeprefix("time/")) for k in [*nodes, "time/step"] if k in keys]
    lines = [s for s in lines if s.values]
    if not lines:
        return None
    lines = [Series(key=s.key, label="whole step" if s.key == "time/step" else s.label, steps=s.steps,
                    values=s.values) for s in lines]
    # Seconds unless every value is under one: then milliseconds, so the axis does not read 0.00...
    if max(max(s.values) for s in lines) < 1.0:
        lines = [Series(key=s.key, label=s.label, steps=s.steps, values=tuple(v * 1e3 for v in s.values))
                 for s in lines]
        return Panel(filename="node_time.png", title="Time per node", ylabel="milliseconds per step",
                     scale="from_zero", series=tuple(lines))
    return Panel(filename="node_time.png", title="Time per node", ylabel="seconds per step", scale="from_zero",
                 series=tuple(lines))


@dataclass(frozen=True, kw_only=True)
class Bar:
    """One node in a step's timeline: its span (first call's start to last call's end, seconds from the step's
    start) and the seconds its calls ran (less than the span where it waited between calls)."""

    node: str
    start: float
    end: float
    busy: float
    planned: tuple[float, float] | None = None  # the plan's span of the node (``NodeEstimate.start_s``, ``end_s``)


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """One step's nodes as bars in start order (``timeline/<node>/start_s``, ``end_s``, ``time/<node>``)."""

    filename: str
    title: str
    step: float
    step_seconds: float
    bars: tuple[Bar, ...]


def choose_timeline(rows: Rows, planned: Mapping[str, tuple[float, float]] | None = None) -> Timeline | None:
    """The timeline of the run's median step (by ``time/step``, among the steps that recorded one; the first step,
    a warm-up, left out when there are others), each node beside its ``planned`` span where given (the run's
    ``plan.json``); None when no step recorded spans."""
    timed = [row for row in rows if _finite(row.get("time/step"))
             and any(str(key).startswith("timeline/") for key in row)]
    if len(timed) > 1:
        timed = timed[1:]
    if not timed:
        return None
    row = sorted(timed, key=lambda r: _number(r["time/step"]))[(len(timed) - 1) // 2]
    nodes = {key.split("/")[1] for key in map(str, row) if key.startswith("timeline/") and key.count("/") == 2}
    spans = {node: (row.get(f"timeline/{node}/start_s"), row.get(f"timeline/{node}/end_s")) for node in nodes}
    bars = [Bar(node=node, start=_number(start), end=_number(end), busy=_number(row.get(f"time/{node}", math.nan)),
                planned=(planned or {}).get(node))
            for node, (start, end) in spans.items() if _finite(start) and _finite(end)]
    if not bars:
        return None
    step = _number(row.get("step", math.nan))
    seconds = _number(row["time/step"])
    return Timeline(filename="timeline.png", title=f"Step {step:g}'s timeline (the median step, {seconds:.3g} s)",
                    step=step, step_seconds=seconds, bars=tuple(sorted(bars, key=lambda b: (b.start, b.node))))


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
