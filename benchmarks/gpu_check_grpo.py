"""One GRPO part of ``benchmarks/gpu_check.py``: plan, train, measure, re-cost (``planner_self`` on one device).

The plan is the planner's (``evaluate_mapping``) for the layout the part pins, executed as it is by
``hybridflow.train.loop.train``; the engines report what they ran (``executed_layout``), which must be the plan.
Measured: mean seconds per graph node and per step after the warm-up steps (``measured_node_times``, the
``hybridflow calibrate`` reader) and ``torch.cuda.max_memory_allocated`` over the steps (the run's
``gpu/max_memory_allocated_gb``). Predicted: the same plan re-costed with the response lengths the run generated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

from gpu_calibrate import detect_device
from gpu_check_parts import Part, Workload

from hybridflow.graph import Graph
from hybridflow.planner import Plan, Sharding, evaluate_mapping
from hybridflow.planner.measured import measured_node_times, settings_as_run
from hybridflow.planner.published import predicted_phases
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.settings import RunSettings
from hybridflow.runtime.executor import LocalExecutor, WorkerGroup
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.train import placement, setup
from hybridflow.train.config import TrainConfig, config_from_dotted

MEMORY_KEY = "gpu/max_memory_allocated_gb"
POLICY = "actor"
DTYPES = {"cuda": "bf16", "cpu": "fp32"}  # the planner's CPU device runs fp32 only


class RecordingExecutor(LocalExecutor):
    """The local executor, keeping what each rank's engines report once they are built."""

    executed: list[dict[str, Any]]
    attention: dict[str, str | None]

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        groups = super().start(plan, specs)
        self.executed = [info for group in self.groups for info in group.info()]
        self.attention = {role: attention_of(engine) for group in self.groups for worker in group.workers
                          for role, engine in worker.engines.items()}
        return groups


def attention_of(engine: Any) -> str | None:
    """The attention implementation of the HF model inside an engine (through hybrid-engine, LoRA and DeepSpeed
    wrappers); None when there is none to read."""
    model = getattr(getattr(engine, "policy_engine", engine), "model", None)
    model = getattr(model, "module", model)  # a DeepSpeed engine
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def run_config(part: Part, model_dir: Path, run_dir: Path, work: Workload, lora: Mapping[str, Any]) -> TrainConfig:
    actor: dict[str, Any] = {"backend": part.backend, **({"lora": dict(lora)} if part.lora else {}),
                             **({"offload": list(part.offload)} if part.offload else {})}
    roles = {"actor": actor, **({} if part.lora else {"reference": {"backend": part.backend}})}
    return config_from_dotted({
        "algorithm": "grpo", "seed": 0, "steps": work.steps, "executor.name": "local", "placement.num_gpus": 1,
        "algorithm.options": {"n": work.samples, "kl_coef": 0.04, "max_new_tokens": work.new_tokens},
        "model.path": str(model_dir), "model.sft_steps": 0, "data.task": "reverse", "data.num_examples": 256,
        "data.batch_size": work.prompts, "optim.actor.lr": 1e-5, "optim.actor.micro_batch_size": work.micro_batch,
        "roles": roles, "output_dir": str(run_dir), "logging.trackers": [], "logging.plot": False,
        "logging.progress": False})


def costed_plan(config: TrainConfig, graph: Graph, part: Part, cluster: str, dtype: str, prompt_len: int,
                settings: RunSettings) -> Plan:
    """The planner's plan for one GPU with the part's layout fixed: sharding, bf16, checkpointing, LoRA, offload
    (``settings``), the config's micro batches."""
    from hybridflow.planner import Cluster

    models = placement.role_models(config, graph, config.model.path)
    adapters = placement.role_adapters(config, graph)
    shared = placement.shared_references(config, graph, models, adapters)
    roles = [role for role in models if role not in shared]
    return evaluate_mapping(PlanRequest(graph, models, placement.workload(config, graph, prompt_len, settings),
                                        Cluster.parse(cluster),
                                        micro_batch_sizes=setup.fixed_micro_batches(config, graph), settings=settings,
                                        support=setup.layout_support(config, graph), lora=adapters or None,
                                        shared_weights=shared), {role: [0] for role in roles},
                            data_parallel_size=dict.fromkeys(roles, 1),
                            sharding=dict.fromkeys(roles, Sharding(part.sharding)), dtypes=dict.fromkeys(roles, dtype),
                            gradient_checkpointing=part.checkpointing)


def with_policy_sharding(plan: Plan, sharding: str) -> Plan:
    """``plan`` with the policy trained under ``sharding``. The planner writes NO_SHARD for one rank, where every
    strategy holds the same bytes and costs the same; the engines still run the strategy's own code (FSDP2's
    ``fully_shard``, ZeRO-2's or ZeRO-3's partitioning), which is what a part checks."""
    groups = tuple(replace(group, layouts=tuple(replace(layout, sharding=Sharding(sharding))
                                                if layout.role == POLICY else layout for layout in group.layouts))
                   for group in plan.groups)
    return replace(plan, groups=groups)


def executed_problems(plan: Plan, executed: list[dict[str, Any]], *, accelerator: bool) -> list[str]:
    """Where an engine ran other than its plan: sharding, checkpointing, padding, offload (on an ``accelerator``,
    FSDP2's offload is its ``CPUOffloadPolicy``; on a CPU the engines report the offload and move nothing)."""
    planned = {layout.role: layout for group in plan.groups for layout in group.layouts}
    problems = []
    for info in executed:
        for role, ran in info["layouts"].items():
            layout = planned[role]
            wanted = {"sharding": str(layout.sharding), "gradient_checkpointing": layout.gradient_checkpointing,
                      "padding": layout.padding,
                      **{f"offload_{part}": part in layout.offloaded for part in ("params", "grads", "optimizer")}}
            problems += [f"{role}: planned {key}={value}, ran {ran.get(key)}" for key, value in wanted.items()
                         if ran.get(key) != value]
            policy = ran.get("offload_policy")
            if accelerator and layout.offloaded and policy is not None and policy != "CPUOffloadPolicy":
                problems.append(f"{role}: planned offload {sorted(layout.offloaded)}, ran FSDP2's {policy}")
    return problems


def ratio(predicted: float | None, measured: float | None) -> float | None:
    if not predicted or not measured:
        return None
    return predicted / measured


@dataclass(frozen=True, kw_only=True)
class PlannedPart:
    """A part's run config, graph and the plan it executes, with the planner inputs to re-cost it."""

    part: Part
    config: TrainConfig
    graph: Graph
    plan: Plan
    cluster: str
    dtype: str
    prompt_len: int
    settings: RunSettings

    def recost(self, metrics: Path) -> Plan:
        """The plan costed again with the response lengths the run generated (``settings_as_run``)."""
        return costed_plan(self.config, self.graph, self.part, self.cluster, self.dtype, self.prompt_len,
                           settings_as_run(self.plan, self.settings, metrics))


def plan_part(part: Part, model_dir: Path, run_dir: Path, work: Workload, lora: Mapping[str, Any], *, cluster: str,
              dtype: str) -> PlannedPart:
    """The part's config and the planner's plan for it on ``cluster``, its policy under the part's sharding."""
    config = run_config(part, model_dir, run_dir, work, lora)
    graph = setup.build_graph(config)
    train_data, _ = setup.prepare_data(config, setup.data_splits(config), setup.policy_tokenizer(config))
    prompt_len = int(train_data.longest_prompt_tokens)
    settings = placement.run_settings(config, graph)
    plan = with_policy_sharding(costed_plan(config, graph, part, cluster, dtype, prompt_len, settings), part.sharding)
    return PlannedPart(part=part, config=config, graph=graph, plan=plan, cluster=cluster, dtype=dtype,
                       prompt_len=prompt_len, settings=settings)


def layout_fields(plan: Plan) -> dict[str, dict[str, Any]]:
    return {layout.role: {"sharding": str(layout.sharding), "dtype": layout.dtype,
                          "gradient_checkpointing": layout.gradient_checkpointing, "padding": layout.padding,
                          "micro_batch_size": layout.micro_batch_size, "offload": sorted(layout.offloaded),
                          "shares_weights_with": layout.shares_weights_with}
            for group in plan.groups for layout in group.layouts}


def run_grpo(part: Part, mode: str, model_dir: Path, run_dir: Path, work: Workload, *, skip_steps: int,
             lora: Mapping[str, Any]) -> dict[str, Any]:
    """Train ``work.steps`` GRPO steps with the part's layout; measured and predicted phases and peak memory."""
    from hybridflow.train.loop import train

    cluster = "1xCPU" if mode == "cpu" else f"1x{detect_device(False)}"
    planned = plan_part(part, model_dir, run_dir, work, lora, cluster=cluster, dtype=DTYPES[mode])
    executor = RecordingExecutor()
    with mock.patch.object(setup, "make_executor", lambda _config: executor):
        result = train(planned.config, plan=planned.plan, overwrite=True)
    problems = executed_problems(planned.plan, executor.executed, accelerator=mode == "cuda")
    measured = measured_node_times(result.metrics_path, skip_steps=skip_steps)
    recosted = planned.recost(result.metrics_path)
    predicted = predicted_phases(recosted, measured)
    phases = {key: {"measured_s": seconds, "predicted_s": predicted.get(key),
                    "ratio": ratio(predicted.get(key), seconds)} for key, seconds in sorted(measured.items())}
    missing = sorted({node.name for node in planned.graph.nodes if node.role} - set(measured))
    if missing:
        problems.append(f"no time measured for the nodes {missing}")
    losses = [(row.get("actor/loss"), row.get("actor/grad_norm")) for row in result.history]
    if not all(value is not None and math.isfinite(value) for pair in losses for value in pair):
        problems.append(f"actor loss or grad norm not finite at every step: {losses}")
    peak = result.history[-1].get(MEMORY_KEY)
    memory = {"measured_bytes": peak * 2**30 if peak is not None else None,
              "predicted_bytes": recosted.groups[0].memory_per_gpu_bytes,
              "source": "torch.cuda.max_memory_allocated" if peak is not None else "none on a CPU"}
    memory["ratio"] = ratio(memory["predicted_bytes"], memory["measured_bytes"])
    return {"cluster": cluster, "prompt_len": planned.prompt_len, "steps": len(result.history),
            "skip_steps": skip_steps, "feasible": recosted.feasible, "planner_problems": list(recosted.problems),
            "layouts": layout_fields(planned.plan), "executed": executor.executed, "attention": executor.attention,
            "phases": phases, "memory": memory, "losses": losses, "problems": problems}
