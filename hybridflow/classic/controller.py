"""``SingleController``: the tutorial's entry point over the planner and the runtime.

``SingleController(config=dp_config, actor_model=..., critic_model=..., reward_model=...,
reference_model=...)`` checks the mapping with the planner (``plan()``), trains on it
(``fit()``) and keeps the result (``save()``/``load()``). It adds no placement logic of its own:
the mapping becomes a :class:`~hybridflow.planner.Plan` that the runtime executes as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.classic.config import ROLLOUT, DataParallelConfig
from hybridflow.graph import Graph, RoleKind, Workload, load_graph
from hybridflow.planner import (
    Cluster,
    LayoutSupport,
    ModelSpec,
    Plan,
    PlanRequest,
    RunSettings,
    compare_plans,
    evaluate_mapping,
    plan_placement,
)

if TYPE_CHECKING:
    from hybridflow.train.config import TrainConfig

ROLE_ARGS = {"actor": "actor_model", "critic": "critic_model", "reward": "reward_model",
             "reference": "reference_model"}


# What ``settings`` default to here (dotted keys of the training config, the same schema as ``hybridflow train``).
CLASSIC_DEFAULTS: dict[str, Any] = {"steps": 10, "output_dir": "runs/classic", "logging.progress": False,
                                    "data.batch_size": 8, "algorithm.options.max_new_tokens": 12}
DRY_RUN_PROMPT_LEN = 16  # prompt tokens of the workload plan() costs when no Workload is passed


@dataclass(frozen=True, kw_only=True)
class PlanCheck:
    """The mapping as the planner sees it, beside the plan it would choose, and why they differ."""

    manual: Plan
    auto: Plan
    unused_gpus: tuple[int, ...]
    explanation: str

    def __str__(self) -> str:
        spare = f"GPUs {list(self.unused_gpus)} are unused by this mapping.\n" if self.unused_gpus else ""
        risks = "".join(f"OOM risk: {problem}\n" for problem in self.manual.problems)
        return f"{spare}{risks}{self.explanation}"


class SingleController:
    """Drives training for a :class:`DataParallelConfig` mapping; models are local HF paths or tiny names."""

    def __init__(self, *, config: DataParallelConfig, actor_model: str, critic_model: str | None = None,
                 reward_model: str | None = None, reference_model: str | None = None,
                 use_half_precision: bool = False, settings: TrainConfig | Mapping[str, Any] | None = None) -> None:
        from hybridflow.train.config import TrainConfig, config_from_dotted

        self.config = config
        self.use_half_precision = use_half_precision
        given = {"actor": actor_model, "critic": critic_model, "reward": reward_model, "reference": reference_model}
        self.models = {role: model for role, model in given.items() if model is not None}
        if isinstance(settings, TrainConfig):
            self.settings = settings
        else:  # PPO with a critic, GRPO without one, unless the caller says otherwise
            algorithm = {"algorithm": "ppo" if "critic" in self.models else "grpo"}
            self.settings = config_from_dotted(dict(settings or {}), {**CLASSIC_DEFAULTS, **algorithm})
        for role, model in self.models.items():
            if role != "actor" and config.mesh(role) is None:
                raise ValueError(f"SingleController: {ROLE_ARGS[role]}={model!r} is given but "
                                 f"DataParallelConfig.{role}_model_device_mesh is not; give it a mesh")
        for role in config.meshes:
            if role not in self.models:
                raise ValueError(f"SingleController: DataParallelConfig.{role}_model_device_mesh is set but "
                                 f"{ROLE_ARGS[role]} is missing")
        for role, model in self.models.items():  # a missing path fails here, not at plan() or fit()
            try:
                ModelSpec.parse(model)
            except (KeyError, ValueError, OSError) as err:
                raise ValueError(f"SingleController: {ROLE_ARGS[role]}={model!r} is neither a local HF model "
                                 f"directory nor a known model name: {err}") from err
        self._resume_from: Path | None = None
        self._resume_name = ""
        self.result: Any = None

    @property
    def cluster(self) -> Cluster:
        return Cluster.parse(self.config.cluster or f"{self.config.num_gpus}xA100-80G")

    def graph(self) -> Graph:
        """The settings' algorithm with a reward model when one is given, the task's rule otherwise; multi-turn in an
    environment when the settings' ``agent.environment`` names one (``settings={"agent.environment": ...}``)."""
        from hybridflow.train.setup import with_agent

        kind = RoleKind.REWARD_MODEL if "reward" in self.models else RoleKind.REWARD_FUNCTION
        graph = load_graph(self.settings.algorithm.name, **{**self.settings.algorithm.options, "reward_kind": kind})
        return with_agent(self.settings, graph)  # settings' agent section: a multi-turn rollout with tools

    @property
    def workload(self) -> Workload:
        """What ``plan()`` costs by default: the settings' prompts per step and response length."""
        return Workload(batch_size=self.settings.data.batch_size, prompt_len=DRY_RUN_PROMPT_LEN,
                        response_len=self.graph().max_new_tokens)

    def dtypes(self) -> dict[str, str]:
        """Inference roles in half precision when asked: bf16 where the device has it, else fp16 (T4, V100)."""
        if not self.use_half_precision:
            return {}
        cluster, out = self.cluster, dict[str, str]()
        for role in ("reward", "reference"):
            mesh = self.config.mesh(role)
            if mesh is not None and role in self.models:
                device = cluster.machine_of(mesh[0]).device
                out[role] = "bf16" if device.supports("bf16") else "fp16"
        return out

    def model_specs(self, graph: Graph) -> dict[str, ModelSpec]:
        return {role.name: ModelSpec.parse(self.models[role.name]) for role in graph.roles if role.kind.needs_gpu}

    def manual_plan(self, workload: Workload | None = None, *,
                    support: Mapping[str, LayoutSupport] | None = None) -> Plan:
        """This mapping, costed by the planner with the config's DP size, strategy and micro batches; ``support``:
        per role, the layouts its backend runs (``fit`` plans for the run's backends, a dry run for any)."""
        graph = self.graph()
        meshes = {role: mesh for role, mesh in self.config.meshes.items() if graph.role(role).kind.needs_gpu}
        dp = self.config.data_parallel_size
        micro = {role: size for role in meshes if (size := self.config.micro_batch_size(role)) is not None}
        # verl's FSDP workers train every role data parallel over its whole mesh (sharded by the
        # strategy); data_parallel_size is the rollout's DP degree, the rest of its mesh its TP.
        rollout = "actor"
        if self.config.rollout_device_mesh is not None:
            rollout = ROLLOUT
            meshes[rollout] = self.config.rollout_device_mesh
        rollout_tp = {rollout: len(meshes[rollout]) // dp} if dp else None
        request = self.plan_request(graph, workload, support=support, micro_batch_sizes=micro)
        return evaluate_mapping(request, meshes, data_parallel_size={role: len(mesh) for role, mesh in meshes.items()},
                                rollout_tp=rollout_tp, sharding=self.config.fsdp_sharding_strategy,
                                dtypes=self.dtypes())

    def plan_request(self, graph: Graph, workload: Workload | None = None, *,
                     support: Mapping[str, LayoutSupport] | None = None,
                     micro_batch_sizes: Mapping[str, int] | None = None) -> PlanRequest:
        """The planner's inputs for this run, one request for the mapping's costing and the planner's own choice."""
        return PlanRequest(graph, self.model_specs(graph), workload or self.workload, self.cluster,
                           settings=self.run_settings(graph), support=dict(support or {}),
                           micro_batch_sizes=dict(micro_batch_sizes or {}))

    def run_settings(self, graph: Graph) -> RunSettings:
        """The planner's step recipe from the run's settings (epochs, mini-batches...), as ``hybridflow train``
        derives it."""
        from hybridflow.train.placement import run_settings

        return run_settings(self.settings, graph)

    def plan(self, workload: Workload | None = None, *, show: bool = True) -> PlanCheck:
        """A dry run: this mapping next to the planner's own choice for the same cluster and workload."""
        graph = self.graph()
        work = workload or self.workload
        manual = self.manual_plan(work)
        auto = plan_placement(self.plan_request(graph, work))
        check = PlanCheck(manual=manual, auto=auto, unused_gpus=tuple(self.config.unused_gpus),
                          explanation=compare_plans(auto, manual))
        if show:
            print(check)
        return check

    def fit(self, steps: int | None = None) -> Any:
        """Train on this mapping; returns the run's :class:`~hybridflow.train.loop.TrainResult`."""
        from hybridflow.train.config import ModelConfig, RoleConfig
        from hybridflow.train.loop import train
        from hybridflow.train.setup import layout_support

        # A role the strategy shards runs on FSDP (as verl's FSDP workers do) unless the settings name its
        # backend; the mapping is costed for those backends, and each role's micro batch is the plan's.
        roles = {role: RoleConfig(model=self._role_model(role), backend=self._backend(role),
                                  max_concurrent_requests=self.config.max_concurrent_requests(role))
                 for role in self.models}
        graph = self.graph()
        support = layout_support(replace(self.settings, roles={**self.settings.roles, **roles}), graph)
        plan = self.manual_plan(support=support)
        roles = {role: replace(entry, micro_batch_size=plan.layout(role).micro_batch_size)
                 for role, entry in roles.items() if plan.group_index(role) is not None}
        sharded = sorted(role for role, entry in roles.items() if entry.backend == "fsdp")
        if sharded and self.settings.executor.name == "local":
            raise ValueError(f"SingleController.fit: fsdp_sharding_strategy={self.config.fsdp_sharding_strategy!r} "
                             f"shards {sharded} with the fsdp backend, whose ranks are processes: pass "
                             "settings={'executor.name': 'ray'} (or fsdp_sharding_strategy='NO_SHARD' to train "
                             "replicas in this process)")
        actor = self.models["actor"]
        model = ModelConfig(path=actor) if Path(actor).is_dir() else replace(self.settings.model, name=actor)
        settings = replace(
            self.settings, steps=steps or self.settings.steps, model=model, roles={**self.settings.roles, **roles},
            placement=replace(self.settings.placement, num_gpus=self.config.num_gpus),
            checkpoint=replace(self.settings.checkpoint, every=self.settings.checkpoint.every or (
                steps or self.settings.steps)),
            data=replace(self.settings.data, reward_cache_size=self.config.reward_cache_size
                         if self.config.enable_reward_cache else 0))
        run_dir = Path(settings.output_dir)
        resume = self._resume_from is not None
        if resume:
            assert self._resume_from is not None
            _copy_tree(self._resume_from / "checkpoint", run_dir / "checkpoints" / self._resume_name)
        # SIGTERM: train() checkpoints the last finished step and raises Terminated (hybridflow/train/signals.py)
        self.result = train(settings, resume=resume, graph=graph, plan=plan)
        return self.result

    def _backend(self, role: str) -> str | None:
        """The settings' backend for ``role``; else ``fsdp`` where the strategy shards its mesh, None (the
        default) otherwise."""
        given = self.settings.roles.get(role)
        if given is not None and given.backend:
            return given.backend
        mesh = self.config.mesh(role) or ()
        return "fsdp" if len(mesh) > 1 and self.config.fsdp_sharding_strategy != "NO_SHARD" else None

    def _role_model(self, role: str) -> str | None:
        """A local directory for this role, or None to start from the actor's (SFT-warmed) weights.

        As in verl, the reference, critic and reward model default to the actor's checkpoint; a
        built-in tiny name can only mean that, so it must be the actor's name.
        """
        model = self.models[role]
        if role == "actor" or Path(model).is_dir():
            return None if role == "actor" else model
        if model != self.models["actor"]:
            raise ValueError(f"SingleController: {ROLE_ARGS[role]}={model!r} is neither a local model directory nor "
                             f"the actor's built-in model {self.models['actor']!r}")
        return None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Copy the last checkpoint, plan and config of ``fit()`` to ``path``, atomically."""
        from hybridflow.train.checkpoint import latest_checkpoint

        run_dir = Path(self.settings.output_dir)
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"nothing to save: {run_dir} has no checkpoint yet; call fit() first")
        target = Path(path)
        replaceable = target.is_dir() and ((target / "saved.json").is_file() or not any(target.iterdir()))
        if target.exists() and not replaceable:
            raise FileExistsError(f"SingleController.save: {str(target)!r} exists and was not written by save() (no "
                                  "saved.json); refusing to replace it: choose an absent or empty directory")
        if target.resolve() == run_dir.resolve() or run_dir.resolve().is_relative_to(target.resolve()):
            raise ValueError(f"SingleController.save: {str(target)!r} holds the run directory {str(run_dir)!r} it "
                             "would copy from: choose a directory outside it")
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(checkpoint, tmp / "checkpoint")
        for name in ("plan.json", "config.json"):
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, tmp / name)
        (tmp / "saved.json").write_text(json.dumps({"checkpoint": checkpoint.name}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        return target

    def load(self, path: str | os.PathLike[str]) -> None:
        """Resume the next ``fit()`` from a directory written by :meth:`save`."""
        source = Path(path)
        saved = source / "saved.json"
        if not saved.is_file():
            raise FileNotFoundError(f"{source} was not written by SingleController.save() (no saved.json)")
        name = json.loads(saved.read_text()).get("checkpoint")
        # The name becomes a path under the run directory that fit() replaces: only a checkpoint's own name.
        if not isinstance(name, str) or not re.fullmatch(r"step_\d+", name) or not (source / "checkpoint").is_dir():
            raise ValueError(f"{saved} does not describe a saved checkpoint (checkpoint={name!r}, expected step_N "
                             f"and a checkpoint/ folder beside it); save it again with SingleController.save()")
        self._resume_from = source
        self._resume_name = name


def _copy_tree(source: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target)
