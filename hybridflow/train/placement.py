"""``placement: auto | manual``: plan a run's roles with the planner before it starts.

``auto`` executes the planner's plan for the declared ``cluster``; ``manual`` costs the ``meshes``
the config gives per role with the same model (and refuses a mapping that does not fit). Plans are
made for the run's real workload (prompts per step, samples, prompt and response lengths) and
models (a built-in tiny name or a local HF directory).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from hybridflow.graph import Graph, Op, Workload
from hybridflow.planner import (
    Calibration,
    Cluster,
    ModelSpec,
    Plan,
    PlannerOptions,
    detachable_policies,
    evaluate_mapping,
    plan_placement,
    rollout_role,
)
from hybridflow.planner.settings import RunSettings, settings_from_dict
from hybridflow.train.config import TrainConfig


def role_models(config: TrainConfig, graph: Graph, model_dir: str | None = None) -> dict[str, ModelSpec]:
    """A planner spec per GPU role: its own directory if configured, else the policy's model (``model_dir``,
    the run's starting weights, when known: a built-in tiny model's real vocabulary is the tokenizer's)."""
    policy = model_dir or config.model.path or config.model.name
    specs = {}
    for role in graph.roles:
        if role.kind.needs_gpu:
            override = config.roles.get(role.name)
            model = override.model if override is not None and override.model else policy
            specs[role.name] = ModelSpec.from_hf_config(model) if Path(model).exists() else ModelSpec.preset(model)
    return specs


def workload(config: TrainConfig, graph: Graph, prompt_len: int, settings: RunSettings | None = None) -> Workload:
    """The run's workload; responses as long as ``max_new_tokens`` unless ``settings`` give a length distribution
    (then its mean, which the graph sizes its edges with)."""
    response = max_new_tokens(graph)
    if settings is not None and settings.lengths is not None:
        response = max(1, round(settings.lengths.mean))
    return Workload(batch_size=config.data.batch_size, prompt_len=prompt_len, response_len=response)


def max_new_tokens(graph: Graph) -> int:
    lengths = [int(node.option("max_new_tokens", 32) or 32) for node in graph.nodes if node.op is Op.GENERATE]
    return max(lengths, default=32)


def run_settings(config: TrainConfig, graph: Graph) -> RunSettings:
    """``planner_settings`` as the planner's step recipe; ``mean_response_len`` becomes a lognormal capped at the
    graph's ``max_new_tokens``. Errors name the config key."""
    data = dict(config.planner_settings)
    mean = data.pop("mean_response_len", None)
    where, cap = "config key 'planner_settings'", max_new_tokens(graph)
    if mean is not None:
        if "lengths_from" in data or "max_response_len" in data:
            raise ValueError(f"{where}: give mean_response_len or lengths_from, not both (max_response_len is the "
                             "generate node's max_new_tokens)")
        if isinstance(mean, bool) or not isinstance(mean, int | float) or not 0 < mean <= cap:
            raise ValueError(f"{where}.mean_response_len={mean!r} must be a number of tokens in (0, max_new_tokens="
                             f"{cap}]")
        data["max_response_len"] = cap
    return settings_from_dict(data, mean_response_len=round(mean or cap), where=where)


def planner_cluster(config: TrainConfig) -> Cluster:
    """The config's ``cluster`` (default ``{num_gpus}xCPU``) with the cores its logical GPUs share."""
    cluster = Cluster.parse(config.cluster or f"{config.num_gpus}xCPU")
    return replace(cluster, host_cores=host_cores(config, cluster))


def host_cores(config: TrainConfig, cluster: Cluster) -> int | None:
    """The cores the logical GPUs share: the config's, or this machine's for ``auto`` (CPU clusters only)."""
    if config.host_cores != "auto":
        return config.host_cores
    if any(machine.device.name != "CPU" for machine in cluster.machines):
        raise ValueError(f"config key 'host_cores'='auto' counts this machine's cores for logical CPU GPUs; the "
                         f"cluster {cluster.spec!r} has {list(cluster.device_names)}: drop the key")
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def planned(config: TrainConfig, graph: Graph, prompt_len: int, model_dir: str | None = None) -> Plan:
    """The plan ``config.placement`` asks for; raises naming the key at fault."""
    cluster = planner_cluster(config)
    settings = run_settings(config, graph)
    models, work = role_models(config, graph, model_dir), workload(config, graph, prompt_len, settings)
    calibration = Calibration.load(config.calibration) if config.calibration else None
    if config.placement == "auto":
        # The installed training backends are data parallel only: plan what they can run.
        plan = plan_placement(graph, models, work, cluster, calibration=calibration, settings=settings,
                              options=PlannerOptions(max_tp=1, separate_rollout=config.separate_rollout,
                                                     pipeline=config.pipeline, max_staleness=_bound(config)))
    else:
        gpu_roles = set(models)
        missing = sorted(gpu_roles - set(config.meshes))
        if missing:
            raise KeyError(f"config key 'meshes': placement=manual needs a mesh for every GPU role; missing {missing}")
        rollouts = {rollout_role(policy) for policy in detachable_policies(graph)}
        extra = sorted(set(config.meshes) - gpu_roles - rollouts)
        if extra:
            raise KeyError(f"config key 'meshes': {extra} are not GPU roles of the {graph.name} graph "
                           f"(GPU roles: {sorted(gpu_roles)}; a policy's rollout on GPUs of its own: "
                           f"{sorted(rollouts)})")
        plan = evaluate_mapping(graph, models, work, cluster, config.meshes, calibration=calibration, settings=settings,
                                data_parallel_size={role: len(mesh) for role, mesh in config.meshes.items()},
                                pipeline=config.pipeline, max_staleness=_bound(config),
                                stream_chunks=config.stream_chunks)
        if not plan.feasible:
            raise ValueError(f"config key 'meshes': the mapping does not fit: {'; '.join(plan.problems)}")
    _check_executable(plan)
    return plan


def _bound(config: TrainConfig) -> int | None:
    """The async bound the planner costs: the config's for pipeline=async, its choice (1 or 2) for auto."""
    return config.max_staleness if config.pipeline == "async" else None


def _check_executable(plan: Plan) -> None:
    for group in plan.groups:
        for layout in group.layouts:
            if layout.tp != 1:
                raise ValueError(f"the plan gives role {layout.role!r} tensor parallel size {layout.tp}, which no "
                                 "installed training backend runs; use placement=manual with data-parallel meshes")
