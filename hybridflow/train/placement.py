"""The ``placement`` section and ``placement.mode: auto | manual``: plan the roles before the run starts.

``auto`` executes the planner's plan for the declared ``placement.cluster``; ``manual`` costs the ``meshes``
the config gives per role with the same model (and refuses a mapping that does not fit). Plans are
made for the run's real workload (prompts per step, samples, prompt and response lengths) and
models (a built-in tiny name or a local HF directory).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hybridflow.graph import Graph, Workload
from hybridflow.planner import (
    Calibration,
    Cluster,
    LayoutSupport,
    LengthDistribution,
    ModelSpec,
    Plan,
    PlannerOptions,
    PlanRequest,
    detachable_policies,
    evaluate_mapping,
    plan_placement,
    rollout_role,
)
from hybridflow.planner.agents import WORKLOAD_KEYS, AgentWorkload
from hybridflow.planner.lora_costs import LoraPlan, adapter_sync_refusal, sync_mode
from hybridflow.planner.models import from_config_dict
from hybridflow.planner.problem import shareable_references
from hybridflow.planner.settings import Offload, RunSettings, parse_offload
from hybridflow.runtime.protocols import DEFAULT_ROLLOUT

if TYPE_CHECKING:
    from hybridflow.train.config import TrainConfig


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
        "mini_batch_size": "optim.actor.mini_batches", "epochs": "optim.actor.epochs",
        "max_prompt_len": "data.max_prompt_length",
        "max_response_len": "the generate node's max_new_tokens (algorithm.options)",
        "gpu_memory_utilization": "roles.<policy>.rollout_options.gpu_memory_utilization",
        "rollout_sleep": "roles.<policy>.rollout_options.sleep_level",
        "offload": "roles.<name>.offload"}

    def __post_init__(self) -> None:
        if self.lengths_from and self.mean_response_len is not None:
            raise ValueError("config keys 'placement.planner.lengths_from' and 'placement.planner.mean_response_len' "
                             "conflict: give one")
        self.agent_workload()

    def agent_workload(self) -> AgentWorkload | None:
        """The ``agent`` mapping as the planner's input (None: not given); errors name the config key."""
        if self.agent is None:
            return None
        if not isinstance(self.agent, Mapping):
            raise ValueError(f"config key 'placement.planner.agent' must be a mapping of {list(WORKLOAD_KEYS)}")
        return AgentWorkload.from_mapping(self.agent, where="config key 'placement.planner.agent'")

    def __bool__(self) -> bool:
        return bool(self.lengths_from) or self.mean_response_len is not None or self.agent is not None


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """The ``placement`` section: where each role runs.

    ``mode``: ``default`` (every role on one group of ``num_gpus`` GPUs, or the ``plan_file`` as it is),
    ``auto`` (the planner's plan for ``cluster``) or ``manual`` (``meshes`` per role, costed by the planner).
    ``cluster``: a planner cluster spec such as ``4xA100-80G+2xT4`` (default ``{num_gpus}xCPU``); ``meshes``:
    role -> GPU ids (``actor:rollout`` detaches a rollout); ``separate_rollout``: ``auto`` also considers rollout
    GPUs apart from the trainer's; ``calibration``: the cost model's fitted constants (a file from
    ``hybridflow calibrate`` or a shipped name); ``host_cores``: on logical CPU GPUs, the cores they share
    (``auto``: this machine's; unset: one each); ``planner``: what the planner costs that the run cannot state.
    """

    SHORT: typing.ClassVar[str] = "mode"
    mode: Literal["default", "auto", "manual"] = "default"
    num_gpus: int = 1
    cluster: str | None = None
    meshes: dict[str, list[int]] = field(default_factory=dict)
    plan_file: str | None = None
    separate_rollout: bool = False
    calibration: str | None = None
    host_cores: int | Literal["auto"] | None = None
    planner: PlannerInputs = field(default_factory=PlannerInputs)

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError(f"config key 'placement.num_gpus'={self.num_gpus} must be >= 1")
        if self.mode != "default" and self.plan_file:
            raise ValueError(f"config keys 'placement.mode'={self.mode!r} and 'placement.plan_file' conflict: a plan "
                             "file is executed as it is; drop one of them")
        if self.meshes and self.mode != "manual":
            raise ValueError("config key 'placement.meshes' is only read with placement.mode=manual")
        for key in ("calibration", "planner", "host_cores"):
            if getattr(self, key) and self.mode == "default":
                raise ValueError(f"config key 'placement.{key}' is only read with placement.mode=auto or manual (the "
                                 "planner's cost model); set the mode or drop the key")
        if self.host_cores is not None and self.host_cores != "auto" and (
                isinstance(self.host_cores, bool) or not isinstance(self.host_cores, int) or self.host_cores < 1):
            raise ValueError(f"config key 'placement.host_cores'={self.host_cores!r} must be a positive integer, "
                             "'auto' (this machine's cores) or null (a core per logical GPU)")
        if self.separate_rollout and self.mode != "auto":
            raise ValueError("config key 'placement.separate_rollout' is only read with placement.mode=auto (with "
                             "manual give the rollout its own mesh, e.g. placement.meshes: {'actor:rollout': [2, 3]})")


def role_models(config: TrainConfig, graph: Graph, model_dir: str | None = None, *,
                vocab_size: int | None = None) -> dict[str, ModelSpec]:
    """A planner spec per GPU role: its own directory if configured, else the policy's model (``model_dir``,
    the run's starting weights, when known; before a built-in tiny model exists, its config with the
    tokenizer's ``vocab_size``). A trainable role's vision tower trains unless ``roles.<name>.freeze_vision_tower``
    or ``lora`` (the runtime's default, verl's), so it is planned with its gradients and optimizer states."""
    policy = model_dir or config.model.path or config.model.name
    specs = {}
    for role in graph.roles:
        if role.kind.needs_gpu:
            override = config.roles.get(role.name)
            model = override.model if override is not None and override.model else policy
            spec = _model_spec(model, vocab_size)
            # LoRA adapts the language model alone: its tower is frozen like the rest of the base
            frozen = override is not None and (override.freeze_vision_tower or override.lora is not None)
            if spec.vision is not None and role.kind.trainable and not frozen:
                spec = replace(spec, vision=spec.vision.with_trainable(True))
            specs[role.name] = spec
    return specs


def _model_spec(model: str, vocab_size: int | None) -> ModelSpec:
    from hybridflow.models.tiny import TINY_CONFIGS  # plain data, no torch

    if Path(model).exists():
        return ModelSpec.from_hf_config(model)
    if model in TINY_CONFIGS and vocab_size:
        return from_config_dict({**TINY_CONFIGS[model][1], "vocab_size": vocab_size}, name=model)
    return ModelSpec.preset(model)


def role_adapters(config: TrainConfig, graph: Graph) -> dict[str, LoraPlan]:
    """The LoRA adapter each GPU role trains (``roles.<name>.lora``), its sync the role's rollout engine's: only
    the adapter for vLLM (the base loaded once), the merged weights for engines without LoRA, or as
    ``rollout_options.lora_sync`` says, or when vLLM cannot take the adapter (what the vLLM rollout runs)."""
    adapters = {}
    for role in graph.roles:
        entry = config.roles.get(role.name)
        raw = getattr(entry, "lora", None)  # the key arrives with the trainers' adapters; absent before
        if entry is None or not raw:
            continue
        where = f"config key 'roles.{role.name}.lora'"
        plan = LoraPlan.from_mapping(raw, where=where)
        options = entry.rollout_options or {}
        sync = options.get("lora_sync") or sync_mode(plan, entry.rollout)
        if sync == "adapter" and options.get("lora_sync") is None and adapter_sync_refusal(
                init=_lora_field(raw, "init", "default"),
                target_modules=plan.target_modules, sleep_level=options.get("sleep_level", 0)):
            sync = "merged"
        adapters[role.name] = replace(plan, sync=sync)
    return adapters


def _lora_field(raw: Any, key: str, default: Any) -> Any:
    """A ``roles.<name>.lora`` field, from a mapping or an :class:`~hybridflow.runtime.protocols.AdapterSpec`."""
    return raw.get(key, default) if isinstance(raw, Mapping) else getattr(raw, key, default)


def shared_references(config: TrainConfig, graph: Graph, models: Mapping[str, ModelSpec],
                      adapters: Mapping[str, LoraPlan]) -> dict[str, str]:
    """References that run on a LoRA policy's engine with its adapter disabled: a frozen role whose model is the
    policy's own (``roles.<reference>.model`` unset or the policy's), so it is the policy's base."""
    shared = {}
    for guest, host in shareable_references(graph, models, adapters).items():
        own, policy = config.roles.get(guest), config.roles.get(host)
        if own is None or not own.model or own.model == (policy.model if policy is not None else None):
            shared[guest] = host
    return shared


def workload(config: TrainConfig, graph: Graph, prompt_len: int, settings: RunSettings | None = None, *,
             image_tokens: int = 0, template_tokens: int | None = None) -> Workload:
    """The run's workload; responses as long as ``max_new_tokens`` unless ``settings`` give a length distribution
    (then its mean, which the graph sizes its edges with); ``image_tokens``: a prompt's visual tokens;
    ``template_tokens``: a judge template's, counted with the run's tokenizer (``train.template_tokens``)."""
    response = graph.max_new_tokens
    if settings is not None and settings.lengths is not None:
        response = max(1, round(settings.lengths.mean))
    return Workload(batch_size=config.data.batch_size, prompt_len=prompt_len, response_len=response,
                    image_tokens=image_tokens, template_tokens=template_tokens)


def run_settings(config: TrainConfig, graph: Graph) -> RunSettings:
    """The planner's step recipe, derived from the run's own keys (the one place that translates them):

    - ``epochs`` and ``mini_batch_size`` from ``optim.actor.epochs`` / ``optim.actor.mini_batches`` (rows per optimizer
      step: the step's samples over its mini-batches);
    - ``max_prompt_len`` from ``data.max_prompt_length``; ``padding`` (padded rows, not packed sequences) from
      ``padding``, which the planner writes into every layout (``RoleLayout.padding``);
    - the token budgets from ``roles.<name>.max_tokens_per_micro_batch`` when every GPU role sets the same one
      (the run's budget; a role's own is a :class:`PlanRequest` input, ``plan_request(token_budgets=...)``, that
      its layouts carry and are costed with);
    - a vLLM rollout's ``gpu_memory_utilization`` and sleep (``roles.<policy>.rollout_options``);
    - offload from ``roles.<name>.offload`` (and DeepSpeed's ``offload_optimizer`` option), which the planner
      writes into the role's layouts (``RoleLayout.offload_*``);
    - the response lengths from ``planner_settings`` (what a run cannot state: ``lengths_from`` an earlier
      run's metrics, or ``mean_response_len``, a lognormal capped at the graph's ``max_new_tokens``).
    """
    inputs, cap = config.placement.planner, graph.max_new_tokens
    lengths = None
    if inputs.lengths_from:
        lengths = LengthDistribution.from_metrics(inputs.lengths_from)
    elif inputs.mean_response_len is not None:
        mean = inputs.mean_response_len
        if isinstance(mean, bool) or not isinstance(mean, int) or not 0 < mean <= cap:
            raise ValueError(f"config key 'placement.planner.mean_response_len'={mean!r} must be a number of tokens "
                             f"in (0, max_new_tokens={cap}]")
        lengths = LengthDistribution.lognormal(mean=mean, max=cap)
    rows = config.data.batch_size * graph.samples_per_prompt
    offload = role_offload(config)
    vllm = next((role.rollout_options for role in config.roles.values() if role.rollout == "vllm"), None)
    budgets = {entry.max_tokens_per_micro_batch if (entry := config.roles.get(role.name)) else None
               for role in graph.roles if role.kind.needs_gpu}
    budget = budgets.pop() if len(budgets) == 1 else None
    actor = config.optim.actor
    return RunSettings(lengths=lengths, epochs=actor.epochs, padding=config.pipeline.padding,
                       train_tokens_per_gpu=budget, forward_tokens_per_gpu=budget,
                       mini_batch_size=-(-rows // actor.mini_batches) if actor.mini_batches > 1 else None,
                       max_prompt_len=config.data.max_prompt_length, offload=offload,
                       gpu_memory_utilization=vllm.get("gpu_memory_utilization") if vllm is not None else None,
                       rollout_sleep=bool(vllm.get("sleep_level")) if vllm is not None else False)


def role_offload(config: TrainConfig) -> tuple[tuple[str, Offload], ...]:
    """What each role keeps in host memory: ``roles.<name>.offload``, plus the optimizer for a DeepSpeed role with
    the ``offload_optimizer`` option (the same thing said the older way)."""
    chosen = []
    for name, role in sorted(config.roles.items()):
        offload = parse_offload(name, role.offload, "roles")
        if role.backend == "deepspeed" and role.options.get("offload_optimizer"):
            offload = replace(offload, optimizer=True)
        if offload.any:
            chosen.append((name, offload))
    return tuple(chosen)


def planner_cluster(config: TrainConfig) -> Cluster:
    """The config's ``cluster`` (default ``{num_gpus}xCPU``) with the cores its logical GPUs share."""
    cluster = Cluster.parse(config.placement.cluster or f"{config.placement.num_gpus}xCPU")
    return replace(cluster, host_cores=host_cores(config, cluster))


def host_cores(config: TrainConfig, cluster: Cluster) -> int | None:
    """The cores the logical GPUs share: the config's, or this machine's for ``auto`` (CPU clusters only)."""
    if config.placement.host_cores != "auto":
        return config.placement.host_cores
    if any(machine.device.name != "CPU" for machine in cluster.machines):
        raise ValueError(f"config key 'placement.host_cores'='auto' counts this machine's cores for logical CPU GPUs; "
                         f"the cluster {cluster.spec!r} has {list(cluster.device_names)}: drop the key")
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def planned(config: TrainConfig, graph: Graph, prompt_len: int, model_dir: str | None = None, *,
            support: Mapping[str, LayoutSupport] | None = None, micro_batch_sizes: Mapping[str, int] | None = None,
            token_budgets: Mapping[str, int] | None = None, vocab_size: int | None = None,
            image_tokens: int = 0, template_tokens: int | None = None) -> Plan:
    """The plan ``config.placement.mode`` asks for; raises naming the key at fault.

    ``support``: per role, the layouts its backend runs (the search proposes nothing else);
    ``micro_batch_sizes`` and ``token_budgets``: what the user fixed, inputs the plan is costed with.
    """
    request = plan_request(config, graph, prompt_len, model_dir, support=support, micro_batch_sizes=micro_batch_sizes,
                           token_budgets=token_budgets, vocab_size=vocab_size, image_tokens=image_tokens,
                           template_tokens=template_tokens)
    if config.placement.mode == "auto":  # with pipeline.stream_chunks > 1 the search keeps streamed or not, the faster
        return plan_placement(replace(request, stream_chunks=config.pipeline.stream_chunks),
                              PlannerOptions(separate_rollout=config.placement.separate_rollout))
    gpu_roles, shared = set(request.models), set(request.shared_weights)
    # a shared reference runs on its host's
    missing = sorted(gpu_roles - set(config.placement.meshes) - shared)
    if missing:
        raise KeyError(f"config key 'placement.meshes': placement.mode=manual needs a mesh for every GPU role; "
                       f"missing {missing}")
    rollouts = {rollout_role(policy) for policy in detachable_policies(graph)}
    extra = sorted(set(config.placement.meshes) - gpu_roles - rollouts)
    if extra:
        raise KeyError(f"config key 'placement.meshes': {extra} are not GPU roles of the {graph.name} graph "
                       f"(GPU roles: {sorted(gpu_roles)}; a policy's rollout on GPUs of its own: "
                       f"{sorted(rollouts)})")
    # The sharding is the planner's to choose among what each backend runs (a mesh fixes GPUs and dp only).
    plan = evaluate_mapping(replace(request, stream_chunks=config.pipeline.stream_chunks), config.placement.meshes,
                            data_parallel_size={role: len(mesh) for role, mesh in config.placement.meshes.items()},
                            sharding=None)
    if not plan.feasible:
        raise ValueError(f"config key 'placement.meshes': the mapping does not fit: {'; '.join(plan.problems)}")
    return plan


def plan_request(config: TrainConfig, graph: Graph, prompt_len: int, model_dir: str | None = None, *,
                 support: Mapping[str, LayoutSupport] | None = None,
                 micro_batch_sizes: Mapping[str, int] | None = None, token_budgets: Mapping[str, int] | None = None,
                 vocab_size: int | None = None, image_tokens: int = 0,
                 template_tokens: int | None = None) -> PlanRequest:
    """The planner's inputs from the run's config, one request for ``placement: auto`` and ``manual`` alike (both add
    ``pipeline.stream_chunks``: a manual mapping's step is costed streamed, the search keeps the faster of streamed
    and not). ``prompt_len``:
    a prompt's text tokens; ``image_tokens``: its images' visual tokens."""
    settings = run_settings(config, graph)
    models = role_models(config, graph, model_dir, vocab_size=vocab_size)
    adapters = role_adapters(config, graph)
    calibration = Calibration.load(config.placement.calibration) if config.placement.calibration else None
    load = workload(config, graph, prompt_len, settings, image_tokens=image_tokens, template_tokens=template_tokens)
    return PlanRequest(graph, models, load, planner_cluster(config),
                       settings=settings, calibration=calibration, support=dict(support or {}),
                       agent=agent_workload(config, graph), lora=adapters or None,
                       shared_weights=shared_references(config, graph, models, adapters),
                       pipeline=config.pipeline.mode, max_staleness=_bound(config),
                       micro_batch_sizes=dict(micro_batch_sizes or {}), token_budgets=dict(token_budgets or {}))


def agent_workload(config: TrainConfig, graph: Graph) -> AgentWorkload | None:
    """``planner_settings.agent`` with prefix caching, where it is unset, that of the policy's rollout engine (vLLM
    caches prefixes; the native rollout recomputes the context every turn). None when the config gives none."""
    agent = config.placement.planner.agent_workload()
    if agent is None or agent.prefix_caching is not None:
        return agent
    engines = {config.roles[name].rollout if name in config.roles else DEFAULT_ROLLOUT
               for name in detachable_policies(graph)}
    return replace(agent, prefix_caching=engines == {"vllm"})


def _bound(config: TrainConfig) -> int | None:
    """The async bound the planner costs: the config's for pipeline=async, its choice (1 or 2) for auto."""
    return config.pipeline.max_staleness if config.pipeline.mode == "async" else None
