"""Multi-turn agentic rollouts in the cost model: a generate node with an ``environment`` option. Torch-free.

Each of the node's ``n`` rows is a trajectory of ``T`` turns (``T`` from :attr:`AgentWorkload.turns`, at most
the node's ``max_turns`` and what its ``max_new_tokens`` budget holds: ``T·τ + (T-1)·o <= max_new_tokens``).
A turn samples ``τ`` tokens (``turn_tokens``, at most ``max_turn_tokens``; by default the node's mean response
less its observations, over the mean turns), then the environment runs ``calls_per_turn`` tool calls one
after another (latency ``L`` each) and answers with ``o`` observation tokens. Every turn re-sends the whole
context ``C_t = P + (t-1)(τ + o)``: with prefix caching only the tokens appended since the last request
(``τ + o``) are prefilled, without it (the native rollout recomputes) all of ``C_t``. ``a_t = n·P(T >= t)``
trajectories are still running at turn t. Decode, prefill and concurrency are the rollout model's own
(:mod:`hybridflow.planner.rollout`: ``decode_seconds``, ``prefill_seconds``, ``concurrency``), per engine.

``turn`` (batch-synchronous turns: all trajectories sample turn t, then all tools run)::

    S_turn = Σ_t [ decode(a_t requests at C_t, tail-bound) + prefill(new tokens of turn t)
                   + E[max of a_t tool waits W] ]          W = sum of calls_per_turn draws of L

``trajectory`` (each trajectory sends its next turn when its tools answer; the engine batches whatever
is ready)::

    S_traj = max(work, path)
    work   = decode(Σ_t a_t requests at the mean C_t, one tail) + Σ_t prefill(new tokens of turn t)
    path   = E[max over the n trajectories of D],   D | T=k = Σ_{t<=k} e_t + (sum of k·calls_per_turn draws of L)
    e_t    = τ · step(κ, C_t + τ/2) + prefill(one trajectory's new tokens of turn t)       (t >= 2)
    e_1    = decode(a_1 requests at C_1, tail-bound) + prefill(turn 1)   (no tool precedes a first turn: every
             trajectory sends it at once and the engine samples them as one batch, as ``turn`` does)

``κ``, the requests the engine holds in steady state, is the in-flight cap ``c`` (``concurrency``) scaled
by the share of a trajectory's time spent on the engine (Little's law, a few fixed-point rounds). Both
schedules add the rollout's phase overhead and controller dispatch once. E[max] is the order statistic
of :mod:`hybridflow.planner.distributions` (sums of lognormal draws moment-matched, Fenton-Wilkinson).

Left out: the spread of turn lengths inside one trajectory's critical path (it decodes mean-length
turns; the tail of lengths enters through ``work``'s drain and ``turn``'s per-turn drain), attention FLOPs
of prefill (as in ``generate_cost``), tool calls of one turn running in parallel, prefix-cache evictions,
tool-server contention, and async/partial rollouts of agent nodes (an ``async`` pool costs them as here).
With several multi-turn nodes the search costs each at its faster schedule, and the plan records the
schedule faster over all of them.

Over 400 lines on purpose: both schedules' formulas above share one turn model (the inputs, the turn
probabilities, the order statistics), kept with the prose that derives them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph, NodeLoad, Op
from hybridflow.graph.node import DEFAULT_MAX_TURNS
from hybridflow.planner.calibration import DEFAULT_CALIBRATION, Calibration
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.costs import Cost, Shape, controller_seconds
from hybridflow.planner.devices import DTYPE_BYTES
from hybridflow.planner.distributions import (
    Distribution,
    Empirical,
    Fixed,
    Lognormal,
    Mixture,
    parse_distribution,
)
from hybridflow.planner.execution import AGENT_SCHEDULES
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.metrics_file import metric, metrics_rows
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.plan import RoleLayout
from hybridflow.planner.rollout import (
    Engine,
    concurrency,
    decode_seconds,
    generate_cost,
    prefill_seconds,
    vision_prefill_seconds,
)
from hybridflow.planner.settings import DEFAULT_SETTINGS, RunSettings

Z95 = 1.645  # the standard normal's 95th percentile: sigma = ln(p95 / p50) / Z95
METRIC_KEYS = ("agent/turns_mean", "agent/turns_max", "agent/tool_calls_per_trajectory", "agent/tool_latency_p50_s",
               "agent/tool_latency_p95_s")
NO_WAIT = Fixed(0.0)
WORKLOAD_KEYS = ("turns", "tool_latency", "calls_per_turn", "observation_tokens", "turn_tokens", "prefix_caching",
                 "from")


@dataclass(frozen=True, kw_only=True)
class AgentWorkload:
    """What a multi-turn rollout does besides sampling: turns per trajectory (None: half the node's ``max_turns``),
    tool latency per call in seconds, tool calls per turn, mean observation tokens per tool answer, mean sampled
    tokens per turn (None: from the node's mean response), and prefix caching (None: the engine's default, on
    for vLLM, off for the native rollout). Distributions may be given as text (``lognormal:median=0.1,sigma=1``)."""

    turns: Distribution | None = None
    tool_latency: Distribution = NO_WAIT
    calls_per_turn: float = 1.0
    observation_tokens: float = 0.0
    turn_tokens: float | None = None
    prefix_caching: bool | None = None
    source: str = field(default="given", compare=False)  # where the values came from, for the plan's explanation

    def __post_init__(self) -> None:
        if self.turns is not None:
            object.__setattr__(self, "turns", parse_distribution(self.turns, field="AgentWorkload.turns"))
        object.__setattr__(self, "tool_latency", parse_distribution(self.tool_latency,
                                                                    field="AgentWorkload.tool_latency"))
        for name in ("calls_per_turn", "observation_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"AgentWorkload.{name}={value!r} must be a number >= 0")
        tokens = self.turn_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens <= 0):
            raise ValueError(f"AgentWorkload.turn_tokens={tokens!r} must be a positive number of tokens (or None)")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise ValueError(f"AgentWorkload.prefix_caching={self.prefix_caching!r} must be true, false or None")

    @classmethod
    def from_metrics(cls, path: str | Path, **given: Any) -> AgentWorkload:
        """Turns, calls and latency from a run's ``metrics.jsonl`` (the means of its rows): turns a two-point
        distribution with the observed mean and max (:func:`turns_from_mean`), latency a lognormal through the
        p50 and p95 (``sigma = ln(p95/p50) / 1.645``), calls per turn = calls per trajectory / mean turns.
        ``given`` values win over the file's."""
        rows = metrics_rows(path)
        seen = {key: [value for number, row in rows if (value := metric(path, number, row, key)) is not None]
                for key in METRIC_KEYS}
        missing = [key for key in ("agent/turns_mean", "agent/tool_latency_p50_s") if not seen[key]]
        if missing:
            raise ValueError(f"{path}: no {missing} in any record; agent metrics need {list(METRIC_KEYS)}")
        turns = sum(seen["agent/turns_mean"]) / len(seen["agent/turns_mean"])
        top = max(seen["agent/turns_max"], default=turns)
        p50 = sum(seen["agent/tool_latency_p50_s"]) / len(seen["agent/tool_latency_p50_s"])
        p95s = seen["agent/tool_latency_p95_s"]
        p95 = max(sum(p95s) / len(p95s), p50) if p95s else p50
        calls = seen["agent/tool_calls_per_trajectory"]
        values: dict[str, Any] = {
            "turns": turns_from_mean(turns, top),
            "tool_latency": Lognormal(median=p50, sigma=math.log(p95 / p50) / Z95) if p50 > 0 else Fixed(0.0),
            "calls_per_turn": (sum(calls) / len(calls)) / max(turns, 1e-9) if calls else 1.0,
            "source": f"metrics {path}"}
        return cls(**{**values, **given})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str) -> AgentWorkload:
        """From config keys (:data:`WORKLOAD_KEYS`; ``from``: a metrics file the other keys override); errors
        name ``where.key``."""
        unknown = sorted(set(data) - set(WORKLOAD_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {list(WORKLOAD_KEYS)}")
        given = {key: value for key, value in data.items() if key != "from" and value is not None}
        for key in ("turns", "tool_latency"):
            if key in given:
                given[key] = parse_distribution(given[key], field=f"{where}.{key}")
        try:
            if data.get("from"):
                return cls.from_metrics(str(data["from"]), **given)
            return cls(**given)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def describe(self) -> str:
        turns = self.turns.describe() if self.turns is not None else "max_turns/2"
        return (f"turns {turns}, tool latency {self.tool_latency.describe()} s x {self.calls_per_turn:.3g} calls per "
                f"turn, {self.observation_tokens:.3g} observation tokens ({self.source})")


def turns_from_mean(mean: float, top: float) -> Distribution:
    """Integer turns with this mean and largest value ``top``: ``top`` and the integer below the mean, weighted
    to keep the mean (a step's max turns is what its slowest trajectory runs; the mean fixes the engine's work)."""
    top_turns, mean = max(1, round(top)), max(1.0, mean)
    if mean >= top_turns:
        return Fixed(float(top_turns))
    low = max(1, math.ceil(mean) - 1)
    high_share = (mean - low) / (top_turns - low)
    return Empirical(((float(low), 1 - high_share), (float(top_turns), high_share)))


@dataclass(frozen=True, kw_only=True)
class AgentNode:
    """One multi-turn generate node with the inputs it is costed with; ``schedule``: the node's own
    ``agent_schedule`` option (None: the planner chooses); ``defaulted``: no agent inputs were given."""

    node: str
    environment: str
    max_turns: int
    max_turn_tokens: int
    max_new_tokens: int
    workload: AgentWorkload
    schedule: str | None = None
    defaulted: bool = False

    @property
    def turns(self) -> Distribution:
        """The given turns, else half of ``max_turns`` (its two neighbouring integers when that is not one)."""
        if self.workload.turns is not None:
            return self.workload.turns
        half = max(1.0, self.max_turns / 2)
        return turns_from_mean(half, math.ceil(half))


def agent_nodes(graph: Graph, inputs: AgentWorkload | None, *, prefix_caching: bool) -> tuple[AgentNode, ...]:
    """The graph's multi-turn generate nodes (``environment`` set); ``prefix_caching`` is the engine's default
    where ``inputs`` leave it None. No inputs: turns ``max_turns/2``, tool latency fixed 0."""
    found = []
    for node in graph.nodes:
        if node.op is not Op.GENERATE or not node.option("environment"):
            continue
        where = f"node {node.name!r}"
        turns = node.option("max_turns", DEFAULT_MAX_TURNS)
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"{where}: max_turns={turns!r} must be a positive integer")
        cap = node.option("max_turn_tokens") or node.max_new_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"{where}: max_turn_tokens={cap!r} must be a positive integer (default max_new_tokens)")
        schedule = node.option("agent_schedule")
        if schedule is not None and schedule not in AGENT_SCHEDULES:
            raise ValueError(f"{where}: agent_schedule={schedule!r} must be one of {list(AGENT_SCHEDULES)} or unset")
        workload = inputs or AgentWorkload(source="defaults")
        if workload.prefix_caching is None:
            workload = replace(workload, prefix_caching=prefix_caching)
        found.append(AgentNode(node=node.name, environment=str(node.option("environment")), max_turns=turns,
                               max_turn_tokens=cap, max_new_tokens=node.max_new_tokens, workload=workload,
                               schedule=str(schedule) if schedule else None, defaulted=inputs is None))
    if inputs is not None and not found:
        raise ValueError(f"agent inputs were given, but graph {graph.name!r} has no multi-turn generate node (a "
                         "generate node with an 'environment' option); drop them")
    return tuple(found)


def engine_prefix_caching(cluster: Cluster) -> bool:
    """The engine a plan of this cluster assumes when nobody says: vLLM (prefix caching) on GPUs, the native
    rollout (recomputes the context each turn) on CPU devices."""
    return any(machine.device.name != "CPU" for machine in cluster.machines)


@dataclass(frozen=True)
class _Trajectories:
    """The resolved shape of a step's trajectories: ``probs[k-1] = P(T = k)``."""

    probs: tuple[float, ...]
    turn_tokens: float
    observation: float
    prompt: float
    caching: bool

    def alive(self, turn: int) -> float:
        return sum(self.probs[turn - 1:])

    @property
    def mean_turns(self) -> float:
        return sum(k * p for k, p in enumerate(self.probs, start=1))

    def context(self, turn: int) -> float:
        return self.prompt + (turn - 1) * (self.turn_tokens + self.observation)

    def new_tokens(self, turn: int) -> float:
        """Tokens a trajectory's request of ``turn`` prefills."""
        if turn == 1 or not self.caching:
            return self.context(turn)
        return self.turn_tokens + self.observation


def turn_probabilities(turns: Distribution, cap: int) -> tuple[float, ...]:
    """``P(T = k)`` for k = 1..cap: the distribution rounded to integers, mass below 1 at 1 and above ``cap`` at it."""
    if cap <= 1:
        return (1.0,)
    edges = [0.0] + [turns.cdf(k + 0.5) for k in range(1, cap)] + [1.0]
    return tuple(max(0.0, high - low) for low, high in pairwise(edges))


def _trajectories(agent: AgentNode, load: NodeLoad, prompt_len: float) -> _Trajectories:
    rows = max(load.sequences, 1)
    work = agent.workload
    obs = float(work.observation_tokens)
    mean_turns = _mean(turn_probabilities(agent.turns, agent.max_turns))
    tokens = work.turn_tokens or max(1.0, (load.response_tokens / rows - (mean_turns - 1) * obs) / mean_turns)
    tokens = min(float(tokens), float(agent.max_turn_tokens))
    budget = max(1, math.floor((agent.max_new_tokens + obs) / (tokens + obs)))
    probs = list(turn_probabilities(agent.turns, min(agent.max_turns, budget)))
    while len(probs) > 1 and probs[-1] <= 1e-12:  # turns no trajectory reaches
        probs.pop()
    return _Trajectories(probs=tuple(probs), turn_tokens=tokens,
                         observation=obs, prompt=float(prompt_len), caching=bool(work.prefix_caching))


def _mean(probs: tuple[float, ...]) -> float:
    return sum(k * p for k, p in enumerate(probs, start=1))


def _turn_lengths(shape: Shape, tokens: float, cap: int) -> LengthDistribution:
    """A turn's sampled lengths: the run's length shape scaled to mean ``tokens`` and cut at ``cap``, else fixed."""
    lengths = shape.run.lengths
    if lengths is None:
        return LengthDistribution.point(tokens)
    scale = tokens / lengths.mean
    return LengthDistribution(tuple(sorted((min(length * scale, float(cap)), p) for length, p in lengths.points)))


def tool_wait(latency: Distribution, calls: float) -> Distribution:
    """The seconds of ``calls`` sequential tool calls (a fractional count mixes its two neighbouring integers)."""
    if calls <= 0 or latency == Fixed(0.0):
        return Fixed(0.0)
    low = math.floor(calls)
    share = calls - low
    if share < 1e-9:
        return latency.sum_of(low)
    return Mixture(((1 - share, 0.0, latency.sum_of(low)), (share, 0.0, latency.sum_of(low + 1))))


@lru_cache(maxsize=4096)
def _slowest_wait(latency: Distribution, calls: float, trajectories: int) -> float:
    return tool_wait(latency, calls).expected_max(trajectories)


def schedule_seconds(model: ModelSpec, load: NodeLoad, prompt_len: float, layout: RoleLayout, shape: Shape,
                     agent: AgentNode, resident: float = 0.0) -> dict[str, float]:
    """Seconds per step of one multi-turn generate node under each schedule (module docstring)."""
    engine = Engine(model, shape, layout.rollout_tp, DTYPE_BYTES[layout.dtype])
    engines = max(1, shape.size // layout.rollout_tp)
    rows = max(load.sequences, 1)
    traj = _trajectories(agent, load, prompt_len + load.row_image_tokens)  # an image's tokens stay in the context
    lengths = _turn_lengths(shape, traj.turn_tokens, agent.max_turn_tokens)
    latency, calls = agent.workload.tool_latency, float(agent.workload.calls_per_turn)
    active = [max(1, round(rows * traj.alive(t))) for t in range(1, len(traj.probs) + 1)]
    prefills = [prefill_seconds(model, math.ceil(load.prompt_tokens / engines) if t == 1 else
                                math.ceil(n / engines) * traj.new_tokens(t), layout, shape)
                for t, n in enumerate(active, start=1)]
    prefills[0] += vision_prefill_seconds(model, load, engines, layout, shape)
    batch = layout.rollout_batch_size
    turn, first = 0.0, 0.0
    for t, n in enumerate(active, start=1):
        per_engine = math.ceil(n / engines)
        in_flight = concurrency(engine, per_engine, batch or per_engine, traj.context(t), lengths, resident)
        sampled = decode_seconds(engine, per_engine, in_flight, traj.context(t), lengths, n) + prefills[t - 1]
        first = first or sampled
        turn += sampled + _slowest_wait(latency, calls, n)
    requests = sum(active)
    context = sum(n * traj.context(t) for t, n in enumerate(active, start=1)) / requests
    per_engine = math.ceil(rows / engines)
    in_flight = concurrency(engine, per_engine, batch or per_engine, context, lengths, resident)
    work = decode_seconds(engine, math.ceil(requests / engines), in_flight, context, lengths, requests) + sum(prefills)
    path = _critical_path(model, engine, traj, layout, shape, latency, calls, in_flight, per_engine, rows, first)
    fixed = shape.constants.phase_overhead_s + controller_seconds(load, shape, prompt_len)
    return {"trajectory": max(work, path) + fixed, "turn": turn + fixed}


def _critical_path(model: ModelSpec, engine: Engine, traj: _Trajectories, layout: RoleLayout, shape: Shape,
                   latency: Distribution, calls: float, in_flight: int, per_engine: int, rows: int,
                   first: float) -> float:
    """E[the longest trajectory]: its first turn the whole batch's (``first`` seconds), each later turn decoded at
    the engine's sustained concurrency κ (Little's law)."""
    turns = range(1, len(traj.probs) + 1)
    tool_mean = calls * latency.mean

    def own(k: float) -> list[float]:
        return [traj.turn_tokens * engine.step_seconds(k, traj.context(t) + traj.turn_tokens / 2)
                + prefill_seconds(model, traj.new_tokens(t), layout, shape) for t in turns]

    kappa = float(in_flight)
    for _ in range(4):
        busy = sum(traj.alive(t) * e for t, e in zip(turns, own(kappa), strict=True))
        share = busy / (busy + traj.mean_turns * tool_mean) if busy > 0 else 1.0
        kappa = min(float(in_flight), max(1.0, per_engine * share))
    cumulative, elapsed = [], 0.0
    for e in [first, *own(kappa)[1:]]:
        elapsed += e
        cumulative.append(elapsed)
    parts = tuple((p, cumulative[k - 1], tool_wait(latency, k * calls)) for k, p in zip(turns, traj.probs, strict=True)
                  if p > 0)
    return Mixture(parts).expected_max(rows)


def choose_schedule(seconds: Mapping[str, float]) -> str:
    """The faster schedule; a tie keeps ``trajectory`` (it is never slower in the model but for noise)."""
    return "turn" if seconds["turn"] < seconds["trajectory"] * (1 - 1e-9) else "trajectory"


def agent_cost(model: ModelSpec, load: NodeLoad, prompt_len: int, layout: RoleLayout, shape: Shape,
               agent: AgentNode, resident: float = 0.0) -> Cost:
    """The node at its own schedule, else the faster one; memory as a single-turn rollout's engine."""
    seconds = schedule_seconds(model, load, prompt_len, layout, shape, agent, resident)
    schedule = agent.schedule or choose_schedule(seconds)
    return Cost(seconds[schedule], generate_cost(model, load, prompt_len, layout, shape, resident).transient_bytes)


def rollout_cost(model: ModelSpec, load: NodeLoad, prompt_len: int, layout: RoleLayout, shape: Shape,
                 resident: float = 0.0, agent: AgentNode | None = None) -> Cost:
    """A generate node's cost: :func:`agent_cost` for a multi-turn node, ``generate_cost`` otherwise."""
    if agent is None:
        return generate_cost(model, load, prompt_len, layout, shape, resident)
    return agent_cost(model, load, prompt_len, layout, shape, agent, resident)


def explain_schedule(costed: list[tuple[AgentNode, dict[str, float]]], chosen: str) -> str:
    """Why the plan's ``agent_schedule`` is ``chosen``: both schedules' predicted seconds per node, the inputs."""
    parts = []
    for agent, seconds in costed:
        how = "fixed by the node's agent_schedule" if agent.schedule else "the faster"
        inputs = ("no agent inputs given: costed max_turns/2 turns and tool latency fixed 0"
                  if agent.defaulted else agent.workload.describe())
        parts.append(f"{agent.node} ({agent.environment}, max_turns {agent.max_turns}): trajectory "
                     f"{seconds['trajectory']:.3g} s vs turn {seconds['turn']:.3g} s per step, {how}; "
                     f"prefix caching {'on' if agent.workload.prefix_caching else 'off'}; {inputs}")
    return f"agent schedule {chosen}: " + "; ".join(parts)


def predict_agent_schedules(*, model: ModelSpec, workload: AgentWorkload, batch: int, prompt_len: int,
                            max_turns: int = DEFAULT_MAX_TURNS, max_new_tokens: int = 1024,
                            max_turn_tokens: int | None = None, response_len: int | None = None,
                            cluster: Cluster | str = "1xCPU", layout: RoleLayout | None = None,
                            settings: RunSettings | None = None, calibration: Calibration | None = None,
                            rollout: str = "native") -> dict[str, float]:
    """Seconds per step of one multi-turn generate of ``batch`` trajectories (``prompt_len`` prompt tokens each,
    every row its own prompt) on the whole ``cluster`` as one rollout group: ``{"turn": ..., "trajectory": ...}``.

    ``response_len``: the mean response (sampled turns + observations) the default turn length comes from
    (None: ``max_new_tokens``; ``workload.turn_tokens`` overrides it). ``layout``: the rollout's layout (None:
    data parallel over every device, one engine each). ``rollout`` sets prefix caching where the workload leaves
    it None (``vllm``: on; ``native``: off). E.g. a benchmark's tiny model on CPU:
    ``predict_agent_schedules(model=ModelSpec.from_hf_config(dir), workload=AgentWorkload(turns="fixed:3",
    tool_latency="lognormal:median=0.1,sigma=1"), batch=32, prompt_len=64, max_turns=3, max_new_tokens=256)``.
    """
    hardware = Cluster.parse(cluster) if isinstance(cluster, str) else cluster
    device = hardware.machines[0].device
    layout = layout or RoleLayout(role="actor", dp=hardware.num_gpus, dtype=device.preferred_dtype)
    shape = Shape(device, tuple(sorted((m.gpus for m in hardware.machines), reverse=True)),
                  hardware.inter_node_bandwidth, run=settings or DEFAULT_SETTINGS,
                  constants=(calibration or DEFAULT_CALIBRATION).for_device(device.name))
    if workload.prefix_caching is None:
        workload = replace(workload, prefix_caching=rollout == "vllm")
    agent = AgentNode(node="generate", environment="benchmark", max_turns=max_turns,
                      max_turn_tokens=max_turn_tokens or max_new_tokens, max_new_tokens=max_new_tokens,
                      workload=workload)
    load = NodeLoad("generate", Op.GENERATE, batch, batch * prompt_len, batch * (response_len or max_new_tokens))
    return schedule_seconds(model, load, prompt_len, layout, shape, agent)
