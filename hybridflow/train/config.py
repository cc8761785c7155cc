"""The typed training config: frozen dataclasses, loaded from YAML with dotted ``key=value`` overrides.

Unknown keys (all of them at once, hybridflow/train/config_keys.py) and wrong types are rejected with the dotted
key in the message; the dataclasses are the only schema.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hybridflow.data.splits import DataFiles
from hybridflow.planner import ExecutionMode, Plan
from hybridflow.planner.agents import WORKLOAD_KEYS, AgentWorkload
from hybridflow.planner.modes import check_choice
from hybridflow.planner.settings import parse_offload
from hybridflow.runtime.liveness import Liveness
from hybridflow.runtime.protocols import DEFAULT_ROLLOUT, AdapterSpec, OptimSpec
from hybridflow.train.config_keys import checked, flatten

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")  # hybridflow/train/trackers.py


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy's starting point: a local HF directory (``path``) or a tiny config plus an SFT warm start."""

    name: str = "tiny-qwen2"
    path: str | None = None
    sft_steps: int = 100
    sft_batch_size: int = 32
    sft_lr: float = 3e-3


@dataclass(frozen=True, kw_only=True)
class DataConfig(DataFiles):
    """Prompts from a built-in ``task`` or files (jsonl, parquet, a ``datasets`` directory; one or a list) at
    ``path``, read as :class:`~hybridflow.data.splits.DataFiles` says (column keys, splits, validation, prompt length).

    ``reward``: one reward function or a list (``math``, ``file.py:fn``, ``module:fn``; required with
    ``path``), weighed by ``reward_weights``; they run in worker processes, each call within
    ``reward_timeout_s`` seconds (past it the step fails, naming the function and the sample).
    docs/data_and_rewards.md.
    """

    task: str = "reverse"
    path: str | list[str] | None = None
    reward: str | list[str] | None = None
    reward_weights: list[float] | None = None
    reward_timeout_s: float = 60.0
    num_examples: int = 2000
    batch_size: int = 8


@dataclass(frozen=True, kw_only=True)
class OptimConfig(OptimSpec):
    """Optimisation of one trainable role (actor or critic): the runtime's :class:`OptimSpec` plus the micro
    batch its roles take when the user fixes one (rows per forward/backward pass per rank: ``actor`` for the
    policy, reference and reward model, ``critic`` for value models; ``roles.<name>.micro_batch_size`` wins).
    A fixed micro batch is an input of the plan, never a second value at run time; unset, the planner chooses
    (``placement: auto|manual``) or the one-group plan takes 64.

    ``lr_scheduler`` (``constant``, ``linear``, ``cosine``), ``warmup_steps`` or ``warmup_ratio``, and
    ``min_lr_ratio`` (the cosine floor) shape the learning rate over the run's ``steps`` (:class:`OptimSpec`);
    the schedule's length is the run's own, so ``total_steps`` is not a key."""

    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.total_steps:
            raise ValueError("config key 'total_steps' of actor/critic is the run's own: the schedule spans the "
                             "run's 'steps'; drop it")
        if self.lr_scheduler != "constant" or self.warmup_ratio:  # checked again, with the run's steps, in spec()
            object.__setattr__(self, "total_steps", 1)
        try:
            super().__post_init__()
        finally:
            object.__setattr__(self, "total_steps", 0)

    def spec(self, total_steps: int = 0) -> OptimSpec:
        """The runtime's spec, its schedule spanning ``total_steps`` updates (the run's ``steps``)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(OptimSpec)}
        return OptimSpec(**{**values, "total_steps": total_steps})


@dataclass(frozen=True, kw_only=True)
class PlannerInputs:
    """What the planner needs that a run's config cannot state: the response lengths to cost (``placement:
    auto|manual``). ``lengths_from``: an earlier run's metrics.jsonl; ``mean_response_len``: a lognormal with
    that mean, capped at ``max_new_tokens``. Neither: every response costed at ``max_new_tokens``. The rest of
    the planner's step recipe (epochs, mini-batches, prompt cap, offload, the engine's memory) is derived from
    the run's own keys (:func:`hybridflow.train.placement.run_settings`). ``agent``: what a multi-turn generate
    node's trajectories do (keys of :data:`hybridflow.planner.agents.WORKLOAD_KEYS`: ``turns``, ``tool_latency``,
    ``calls_per_turn``, ``observation_tokens``, ``turn_tokens``, ``prefix_caching``, ``from`` an earlier run's
    metrics.jsonl); unset, such a node is costed at half its ``max_turns`` without tool latency."""

    lengths_from: str | None = None
    mean_response_len: int | None = None
    agent: dict[str, Any] | None = None

    # Planner keys a run states itself, and where (an unknown key here names its home).
    STATED_BY_THE_RUN: typing.ClassVar[dict[str, str]] = {
        "mini_batch_size": "actor.mini_batches", "epochs": "actor.epochs", "max_prompt_len": "data.max_prompt_length",
        "max_response_len": "the generate node's max_new_tokens (algorithm_options)",
        "gpu_memory_utilization": "roles.<policy>.rollout_options.gpu_memory_utilization",
        "rollout_sleep": "roles.<policy>.rollout_options.sleep_level",
        "offload": "roles.<name>.offload"}

    def __post_init__(self) -> None:
        if self.lengths_from and self.mean_response_len is not None:
            raise ValueError("config keys 'planner_settings.lengths_from' and 'planner_settings.mean_response_len' "
                             "conflict: give one")
        self.agent_workload()

    def agent_workload(self) -> AgentWorkload | None:
        """The ``agent`` mapping as the planner's input (None: not given); errors name the config key."""
        if self.agent is None:
            return None
        if not isinstance(self.agent, Mapping):
            raise ValueError(f"config key 'planner_settings.agent' must be a mapping of {list(WORKLOAD_KEYS)}")
        return AgentWorkload.from_mapping(self.agent, where="config key 'planner_settings.agent'")

    def __bool__(self) -> bool:
        return bool(self.lengths_from) or self.mean_response_len is not None or self.agent is not None


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Multi-turn rollouts (docs/agents.md): the policy's generate node runs each prompt as a trajectory in
    ``environment`` (an ``ENVIRONMENTS`` name such as ``calculator``, ``guess_number``, ``skyrl``, ``trl``,
    ``openai_agent``, or ``path/file.py:factory``) built with ``options``. ``max_turns`` bounds the turns,
    ``max_turn_tokens`` the tokens sampled per turn (default: the whole response budget, the algorithm's
    ``max_new_tokens``); ``schedule``: ``trajectory`` (each trajectory advances alone), ``turn``
    (batch-synchronous turns) or ``auto`` (the plan's choice with ``placement: auto|manual``, else
    trajectory). The environment's rewards add to the reward function's, times
    ``env_reward_weight``; ``tools_in_prompt`` renders the environment's tool schemas into chat prompts."""

    environment: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_turn_tokens: int | None = None
    schedule: Literal["trajectory", "turn", "auto"] = "auto"
    env_reward_weight: float = 1.0
    tools_in_prompt: bool = True

    def __post_init__(self) -> None:
        if self.environment is None and (self.options or self.max_turn_tokens is not None):
            raise ValueError("config keys 'agent.options' / 'agent.max_turn_tokens' are only read with "
                             "'agent.environment' set (e.g. agent.environment=calculator)")
        for name in ("max_turns", "max_turn_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"config key 'agent.{name}'={value} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class RoleConfig:
    """Per-role overrides under ``roles.<name>``.

    ``model``: a local HF directory for this role (default: the policy's starting weights);
    ``backend``: the backend that runs it (default ``torch``); ``options``: the backend's own options;
    ``rollout``: the engine a policy generates with, a name in the rollout registry (built in: ``native``,
    ``hf_generate``, ``vllm``; docs/backends.md) or a ``file.py:factory`` path, and ``rollout_options`` that
    engine's options; ``micro_batch_size``: rows per forward/backward pass; ``max_tokens_per_micro_batch``: a
    token budget per GPU for the role's update and forward micro batches instead (the layout's fields of that name);
    ``max_concurrent_requests``: most forward requests in flight to the role's workers; ``lora``: train LoRA
    adapters on this policy instead of all its weights (:class:`~hybridflow.runtime.protocols.AdapterSpec`: rank,
    alpha, dropout, target_modules, init); the reference is then its base model with the adapters disabled.
    ``offload``: the trainer state the role keeps in host memory, a list of ``params``, ``grads``, ``optimizer``
    (the layout's ``offload_*`` fields; which combinations each backend runs: docs/backends.md).
    """

    model: str | None = None
    backend: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    rollout: str = DEFAULT_ROLLOUT
    rollout_options: dict[str, Any] = field(default_factory=dict)
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    max_concurrent_requests: int | None = None
    lora: AdapterSpec | None = None
    offload: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        try:
            parse_offload("<name>", self.offload, "roles")
        except ValueError as err:
            raise ValueError(f"config key 'roles.*.offload'={self.offload!r}: give a list of params, grads, "
                             "optimizer") from err
        for name in ("micro_batch_size", "max_tokens_per_micro_batch", "max_concurrent_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"config key 'roles.*.{name}'={value} must be >= 1 (or unset)")
        if "rollout" in self.options:
            raise ValueError("config key 'roles.*.options.rollout' moved: the rollout engine is "
                             "'roles.<name>.rollout' (native, hf_generate, vllm...), its options "
                             "'roles.<name>.rollout_options'")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``hybridflow train`` needs. ``algorithm_options`` go to the graph factory."""

    algorithm: str = "grpo"
    algorithm_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    steps: int = 50
    executor: Literal["local", "ray", "torchrun"] = "local"
    ray_address: str | None = None
    num_gpus: int = 1
    plan_file: str | None = None  # a Plan JSON (e.g. from the planner); default: every role on one group
    # "auto": the planner's plan for ``cluster``; "manual": ``meshes`` per role, costed by the planner.
    placement: Literal["default", "auto", "manual"] = "default"
    cluster: str | None = None  # a planner cluster spec, e.g. "4xA100-80G+2xT4"; default f"{num_gpus}xCPU"
    meshes: dict[str, list[int]] = field(default_factory=dict)  # role -> GPU ids; "actor:rollout" detaches a rollout
    separate_rollout: bool = False  # placement=auto: also consider rollout GPUs apart from the trainer's
    # placement=auto|manual: the cost model's fitted constants (a file from `hybridflow calibrate`, or a shipped name)
    calibration: str | None = None
    # placement=auto|manual: the response lengths the planner costs, e.g. {lengths_from: runs/previous/metrics.jsonl}
    planner_settings: PlannerInputs = field(default_factory=PlannerInputs)
    # placement=auto|manual on logical CPU GPUs: the cores they share ("auto": this machine's); None: one each
    host_cores: int | Literal["auto"] | None = None
    # "one_step_off": a rollout on GPUs of its own generates step t+1 while the trainer trains on step t;
    # "async": it generates continuously, at most ``max_staleness`` updates ahead (docs/runtime.md);
    # "auto": the mode the plan was costed for (placement=auto chooses it, a plan file records it)
    pipeline: Literal["sync", "one_step_off", "async", "auto"] = "sync"
    max_staleness: int = 1  # pipeline=async: how many policy updates a sample's oldest token may lag
    partial_rollout: bool = True  # pipeline=async: weight updates land mid-response (generation in segments)
    segment_tokens: int = 0  # partial rollouts: new tokens per segment (0: a quarter of max_new_tokens)
    # Forward and update passes over padded rows instead of packed sequences (every role's RoleLayout.padding)
    padding: bool = False
    stream_chunks: int = 1  # pipeline=sync: > 1 hands generated rows on in that many chunks (runtime/streaming.py)
    # A synchronous single-pass update (actor.epochs 1, actor.mini_batches 1) takes its old log-probs from its own
    # forward, detached, instead of a log-prob pass before it (hybridflow/graph/skipping.py; TRL does the same)
    skip_known_passes: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    critic: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))
    output_dir: str = "runs/train"
    checkpoint_every: int = 0
    # SIGTERM: the step in flight gets this long to finish (else it is abandoned), then the last finished step is
    # checkpointed and the run exits 143; 0: stop at once, no checkpoint (hybridflow/train/preemption.py)
    sigterm_grace_s: float = 20.0
    keep_checkpoints: int = 0  # > 0: only the newest K checkpoints stay on disk
    validation_every: int = 0  # > 0: a validation pass every N steps (and after the last step)
    validation_samples: int = 8  # completions per validation pass kept in the samples table
    validate_before_train: bool = False  # a validation pass before the first step, logged on step 0's line
    console_metrics_every: int = 0  # > 0: one line of key metrics on stderr every N steps (TRL/verl style)
    # Where metrics go besides metrics.jsonl (always written: `hybridflow report` reads it). docs/configuration.md
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    tensorboard: bool = True
    progress: bool = True
    plot: bool = True
    roles: dict[str, RoleConfig] = field(default_factory=dict)
    reward_cache_size: int = 0  # > 0: an LRU of reward-model scores keyed by prompt + response
    liveness: Liveness = field(default_factory=Liveness)  # deadlines and heartbeats of worker calls (Ray, torchrun)
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn rollouts with tools (docs/agents.md)

    def __post_init__(self) -> None:
        if self.placement != "default" and self.plan_file:
            raise ValueError(f"config keys 'placement'={self.placement!r} and 'plan_file' conflict: a plan file is "
                             "executed as it is; drop one of them")
        if self.meshes and self.placement != "manual":
            raise ValueError("config key 'meshes' is only read with placement=manual")
        if self.calibration and self.placement == "default":
            raise ValueError("config key 'calibration' is only read with placement=auto or manual (the planner's "
                             "cost model); set placement or drop the key")
        for key in ("planner_settings", "host_cores"):
            if getattr(self, key) and self.placement == "default":
                raise ValueError(f"config key {key!r} is only read with placement=auto or manual (the planner's cost "
                                 "model); set placement or drop the key")
        if self.host_cores is not None and self.host_cores != "auto" and (
                isinstance(self.host_cores, bool) or not isinstance(self.host_cores, int) or self.host_cores < 1):
            raise ValueError(f"config key 'host_cores'={self.host_cores!r} must be a positive integer, 'auto' (this "
                             "machine's cores) or null (a core per logical GPU)")
        if self.separate_rollout and self.placement != "auto":
            raise ValueError("config key 'separate_rollout' is only read with placement=auto (with placement=manual "
                             "give the rollout its own mesh, e.g. meshes: {'actor:rollout': [2, 3]})")
        if self.pipeline == "auto" and self.placement != "auto" and not self.plan_file:
            raise ValueError("config key 'pipeline'='auto' takes the mode a plan was costed for: set placement=auto "
                             "(or a plan_file), or name the mode (sync, one_step_off, async)")
        if self.executor == "torchrun" and self.pipeline != "sync":
            raise ValueError(f"config key 'pipeline'={self.pipeline!r}: the torchrun executor runs pipeline=sync only "
                             "(its ranks answer one call stream); use executor=ray or local for overlapped modes")
        # The mode keys, by the one rule: each value as async reads it (whichever mode runs), then the mode.
        ExecutionMode.checked(key=_config_key, pipeline="async", max_staleness=self.max_staleness,
                              segment_tokens=self.segment_tokens)
        if self.pipeline == "auto":
            check_choice("auto", self.max_staleness, self.stream_chunks, key=_config_key)
        else:
            self.execution_mode()
        if self.reward_cache_size < 0:
            raise ValueError(f"config key 'reward_cache_size'={self.reward_cache_size} must be >= 0 (0: off)")
        for name in ("steps", "num_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"config key {name!r}={getattr(self, name)} must be >= 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"config key 'checkpoint_every'={self.checkpoint_every} must be >= 0 (0: never)")
        if not 0 <= self.sigterm_grace_s < math.inf:
            raise ValueError(f"config key 'sigterm_grace_s'={self.sigterm_grace_s} must be a number of seconds >= 0 "
                             "(0: a SIGTERM stops the run at once, without a checkpoint)")
        for name in ("keep_checkpoints", "validation_every", "console_metrics_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"config key {name!r}={getattr(self, name)} must be >= 0 (0: off)")
        if self.validate_before_train and not (self.data.val_path or self.data.val_fraction):
            raise ValueError("config key 'validate_before_train' needs validation prompts: set data.val_path (a file "
                             "or a list) or data.val_fraction")
        unknown = sorted(set(self.trackers) - set(TRACKERS))
        if unknown:
            raise ValueError(f"config key 'trackers' has {unknown}; the trackers are {list(TRACKERS)}")

    def execution_mode(self, plan: Plan | None = None) -> ExecutionMode:
        """The mode the run executes: the config's, or for ``pipeline: auto`` the one ``plan`` was costed for
        (its mode and bound; the config's segments and chunks). ``max_staleness`` applies to async only,
        ``segment_tokens`` to async with ``partial_rollout``. Errors name the config key."""
        pipeline: str = self.pipeline
        staleness = self.max_staleness
        if pipeline == "auto":
            if plan is None:
                raise ValueError("config key 'pipeline'='auto' runs the mode a plan was costed for: pass the plan")
            pipeline, staleness = plan.pipeline, plan.max_staleness
        return ExecutionMode.checked(
            key=_config_key, pipeline=pipeline, max_staleness=staleness if pipeline == "async" else None,
            segment_tokens=self.segment_tokens if pipeline == "async" and self.partial_rollout else None,
            stream_chunks=self.stream_chunks)


def _config_key(name: str) -> str:
    return f"config key {name!r}"


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read YAML (``yaml.safe_load``), apply ``a.b=value`` overrides (values parsed as YAML), validate. TRL's and
    verl's keys are translated (:mod:`hybridflow.train.aliases`); every bad key is named in one error."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise TypeError(f"{path}: the config must be a mapping of keys, not a {type(loaded).__name__}")
        data = loaded or {}
    pairs = flatten(TrainConfig, data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like dotted.key=value")
        pairs += flatten(TrainConfig, {key: yaml.safe_load(raw)})
    return from_mapping(TrainConfig, checked(TrainConfig, pairs))


def config_from_dotted(items: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> TrainConfig:
    """A config from ``{"dotted.key": value}`` pairs (Python values, as a caller writes them) over ``base``."""
    pairs = [pair for key, value in {**(base or {}), **items}.items() for pair in flatten(TrainConfig, {key: value})]
    return from_mapping(TrainConfig, checked(TrainConfig, pairs))


T = typing.TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value type against its fields."""
    if not isinstance(data, Mapping):
        raise TypeError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        home = getattr(cls, "STATED_BY_THE_RUN", {}).get(unknown[0])
        hint = f" (the run states it: {home})" if home else ""
        raise KeyError(f"unknown config key {prefix + unknown[0]!r}{hint}; valid keys here: {sorted(known)}")
    values = {name: _check(hints[name], _over_field_default(cls, name, hints[name], value), prefix + name)
              for name, value in data.items()}
    return cls(**values)


def _over_field_default(cls: type, name: str, hint: Any, value: Any) -> Any:
    """A partial section over the field's own default: ``actor: {grad_clip: 1.0}`` keeps the actor's default
    lr (1e-3), not the section class's (``OptimSpec``: 1e-4). Only what the field's default changes is carried."""
    if not (dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, Mapping)):
        return value
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default_factory is dataclasses.MISSING:
        return value
    try:
        base, own = field.default_factory(), hint()
    except TypeError:  # a section without defaults for every field: nothing to carry
        return value
    changed = {f.name: getattr(base, f.name) for f in dataclasses.fields(hint)
               if f.init and getattr(base, f.name) != getattr(own, f.name)}
    return {**changed, **value}


def _check(hint: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        try:
            return from_mapping(hint, value, key + ".")
        except ValueError as err:  # a section's own check names its field, not where the section sits
            if f"'{key}" in str(err) or "config key" in str(err):
                raise
            raise ValueError(f"config key {key!r}: {err}") from err
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        for arm in arms[1:]:  # ``str | list[str]``: the value may match a later arm
            if typing.get_origin(arm) is list and isinstance(value, list):
                return _check(arm, value, key)
        if len(arms) == 1:
            return _check(arms[0], value, key)
        refusals = []
        for arm in arms:  # ``int | Literal["auto"]``: the first arm that takes the value
            try:
                return _check(arm, value, key)
            except (TypeError, ValueError) as err:
                refusals.append(str(err).removeprefix(f"config key {key!r}={value!r} "))
        raise TypeError(f"config key {key!r}={value!r}: " + "; or ".join(refusals))
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"config key {key!r}={value!r} must be a list")
        return [_check(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)] if args else value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"config key {key!r}={value!r} must be one of {list(args)}")
        return value
    if origin is tuple and args and args[-1] is not Ellipsis:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise TypeError(f"config key {key!r}={value!r} must be a list of {len(args)} values")
        return tuple(_check(arg, item, f"{key}[{i}]") for i, (arg, item) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"config key {key!r} must be a mapping, got {type(value).__name__}")
        item = args[1] if len(args) == 2 else Any
        if dataclasses.is_dataclass(item) and isinstance(item, type):
            return {name: from_mapping(item, entry, f"{key}.{name}.") for name, entry in value.items()}
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML follows YAML 1.1, which reads ``1e-3`` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise TypeError(f"config key {key!r}={value!r} must be a {hint.__name__}, got {type(value).__name__}")
    if hint in (int, float):
        _check_number(value, key)
    return value


INT64_MAX = 2**63 - 1  # torch and numpy hold seeds and counts as int64


def _check_number(value: int | float, key: str) -> None:
    """A numeric config value is finite and fits the int64 every count and seed becomes; ranges are checked
    beside their meaning (``__post_init__``, :mod:`hybridflow.train.preflight`)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config key {key!r}={value!r} must be a finite number")
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        raise ValueError(f"config key {key!r}={value} does not fit a 64-bit integer (at most {INT64_MAX})")
