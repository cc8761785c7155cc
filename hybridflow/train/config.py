"""The typed training config: frozen dataclasses, loaded from YAML with dotted ``key=value`` overrides.

Unknown keys (all of them at once, hybridflow/train/config_keys.py) and wrong types are rejected with the dotted
key in the message; the dataclasses are the only schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from hybridflow.data.reward_service import RewardServiceConfig
from hybridflow.data.splits import DataFiles
from hybridflow.graph.node import DEFAULT_MAX_TURNS
from hybridflow.planner import ExecutionMode, Plan
from hybridflow.planner.settings import parse_offload
from hybridflow.runtime.liveness import Liveness
from hybridflow.runtime.protocols import DEFAULT_ROLLOUT, AdapterSpec, OptimSpec
from hybridflow.train.checkpoint import CheckpointConfig
from hybridflow.train.config_keys import checked, flatten
from hybridflow.train.migration import migrate
from hybridflow.train.pipeline import PipelineConfig
from hybridflow.train.placement import PlacementConfig, PlannerInputs
from hybridflow.train.schema import from_mapping
from hybridflow.train.trackers import LoggingConfig
from hybridflow.train.validation import ValidationConfig

__all__ = ["AgentConfig", "AlgorithmConfig", "CheckpointConfig", "DataConfig", "ExecutorConfig", "LoggingConfig",
           "ModelConfig", "OptimConfig", "OptimSection", "PipelineConfig", "PlacementConfig", "PlannerInputs",
           "RoleConfig", "TrainConfig", "ValidationConfig", "config_from_dotted", "from_mapping", "load_config"]


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The ``algorithm`` section: the graph to run, by ``name`` (a built-in such as ``grpo``, ``ppo``,
    ``rloo``; docs/algorithms.md) or ``path/file.py:factory``, and the ``options`` its factory takes
    (``n``, ``kl_coef``...; every name is checked against the factory's signature at start).
    A plain value is short for the name: ``algorithm: grpo`` is ``algorithm.name: grpo``."""

    SHORT: ClassVar[str] = "name"
    name: str = "grpo"
    options: dict[str, Any] = field(default_factory=dict)


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
    ``reward_timeout_s`` seconds (past it the step fails, naming the function and the sample). A reward named by
    URL (``http://host:port/path``) is a reward service, called as ``reward_service`` says
    (:class:`~hybridflow.data.reward_service.RewardServiceConfig`). docs/data_and_rewards.md.
    """

    task: str = "reverse"
    path: str | list[str] | None = None
    reward: str | list[str] | None = None
    reward_weights: list[float] | None = None
    reward_timeout_s: float = 60.0
    reward_service: RewardServiceConfig = field(default_factory=RewardServiceConfig)
    num_examples: int = 2000
    batch_size: int = 8
    reward_cache_size: int = 0  # > 0: an LRU of reward-model scores keyed by prompt + response

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward_cache_size < 0:
            raise ValueError(f"config key 'data.reward_cache_size'={self.reward_cache_size} must be >= 0 (0: off)")


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
class OptimSection:
    """The ``optim`` section: one :class:`OptimConfig` per trainable kind of role, ``actor`` for the policy
    (its ``micro_batch_size`` also the reference's and the reward model's) and ``critic`` for value models."""

    actor: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    critic: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))

    def of(self, trainable_value: bool) -> OptimConfig:
        """The config of a role: ``critic`` for a value model, else ``actor``."""
        return self.critic if trainable_value else self.actor


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
    max_turns: int = DEFAULT_MAX_TURNS
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
    ``hf_generate``, ``vllm``, ``server``; docs/backends.md) or a ``file.py:factory`` path, and ``rollout_options`` that
    engine's options; ``micro_batch_size``: rows per forward/backward pass; ``max_tokens_per_micro_batch``: a
    token budget per GPU for the role's update and forward micro batches instead (the layout's fields of that name);
    ``max_concurrent_requests``: most forward requests in flight to the role's workers; ``lora``: train LoRA
    adapters on this policy instead of all its weights (:class:`~hybridflow.runtime.protocols.AdapterSpec`: rank,
    alpha, dropout, target_modules, init); the reference is then its base model with the adapters disabled (on a
    vision-language model the adapters go on the language model only). ``freeze_vision_tower``: a trainable
    vision-language role's image encoder does not train (verl's ``actor.freeze_vision_tower``, default false too).
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
    freeze_vision_tower: bool = False
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
                             "'roles.<name>.rollout' (native, hf_generate, vllm, server...), its options "
                             "'roles.<name>.rollout_options'")


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """The ``executor`` section: where the workers run. ``name``: ``local`` (in this process), ``ray`` (a local
    cluster, or the one at ``ray_address``) or ``torchrun`` (a rank per GPU, docs/torchrun.md); ``liveness``:
    the deadlines and heartbeats of worker calls (Ray, torchrun; :class:`~hybridflow.runtime.liveness.Liveness`)."""

    SHORT: ClassVar[str] = "name"
    name: Literal["local", "ray", "torchrun"] = "local"
    ray_address: str | None = None
    liveness: Liveness = field(default_factory=Liveness)

    def __post_init__(self) -> None:
        if self.ray_address and self.name != "ray":
            raise ValueError(f"config key 'executor.ray_address' is only read with executor.name=ray (not "
                             f"{self.name!r}); set the name or drop the address")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``hybridflow train`` needs: the run's length, seed and folder, and one section per component
    (docs/configuration.md has the whole tree). A section whose class names a ``SHORT`` field takes a plain value
    for it: ``algorithm: grpo``, ``executor: ray``, ``placement: auto``, ``pipeline: async``."""

    seed: int = 0
    steps: int = 50
    output_dir: str = "runs/train"
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    roles: dict[str, RoleConfig] = field(default_factory=dict)
    agent: AgentConfig = field(default_factory=AgentConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"config key 'steps'={self.steps} must be >= 1")
        _cross_checks(self)

    def execution_mode(self, plan: Plan | None = None) -> ExecutionMode:
        """The mode the run executes (:meth:`PipelineConfig.execution_mode`); with ``placement.mode: auto`` and
        ``pipeline.stream_chunks`` > 1, streamed or not as the search chose (``plan.extra["stream_choice"]``)."""
        mode = self.pipeline.execution_mode(plan)
        if plan is not None and "stream_choice" in dict(plan.extra) and self.placement.mode == "auto":
            return replace(mode, stream_chunks=plan.mode.stream_chunks)
        return mode


def _cross_checks(config: TrainConfig) -> None:
    """The rules that join two sections, each naming both keys (a section checks its own keys itself)."""
    placement, pipeline = config.placement, config.pipeline
    if pipeline.mode == "auto" and placement.mode != "auto" and not placement.plan_file:
        raise ValueError("config key 'pipeline.mode'='auto' takes the mode a plan was costed for: set "
                         "placement.mode=auto (or placement.plan_file), or name the mode (sync, one_step_off, async)")
    if config.executor.name == "torchrun" and pipeline.mode != "sync":
        raise ValueError(f"config key 'pipeline.mode'={pipeline.mode!r}: executor.name=torchrun runs pipeline.mode="
                         "sync only (its ranks answer one call stream); use executor.name=ray or local for overlapped "
                         "modes")
    if config.validation.before_train and not (config.data.val_path or config.data.val_fraction):
        raise ValueError("config key 'validation.before_train' needs validation prompts: set data.val_path (a file "
                         "or a list) or data.val_fraction")


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
    return from_mapping(TrainConfig, checked(TrainConfig, migrate(pairs)))


def config_from_dotted(items: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> TrainConfig:
    """A config from ``{"dotted.key": value}`` pairs (Python values, as a caller writes them) over ``base``."""
    pairs = [pair for key, value in {**(base or {}), **items}.items() for pair in flatten(TrainConfig, {key: value})]
    return from_mapping(TrainConfig, checked(TrainConfig, migrate(pairs)))
