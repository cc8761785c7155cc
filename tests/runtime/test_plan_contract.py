"""The plan is the contract: backends declare what they run, the planner plans only that, the controller refuses
the rest before any model loads, and the engines run exactly the plan's layouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import DEFAULT_MAX_NEW_TOKENS, RoleKind, Workload, load_graph
from hybridflow.planner import (
    ANY_LAYOUT,
    Cluster,
    GroupPlan,
    InfeasibleError,
    LayoutSupport,
    ModelSpec,
    Plan,
    RoleLayout,
    Sharding,
    evaluate_mapping,
    plan_placement,
)
from hybridflow.planner.request import PlanRequest
from hybridflow.registry import BACKENDS
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, SamplingParams, default_plan
from hybridflow.runtime.executor import LocalExecutor
from hybridflow.train import setup
from hybridflow.train.config import load_config
from hybridflow.train.prepare import prepare_run

TOKENIZER = char_tokenizer()
LLAMA = ModelSpec.preset("llama3-8b")
GRPO = load_graph("grpo")
WORK = Workload(batch_size=256, prompt_len=512, response_len=512)
ROLES = ("actor", "reference", "reward")


def _support(name: str) -> dict[str, LayoutSupport]:
    return dict.fromkeys(ROLES, BACKENDS.get(name).support)


def test_the_search_plans_only_what_the_backends_run() -> None:
    cluster = Cluster.parse("8xA100-80G")
    models = dict.fromkeys(ROLES, LLAMA)
    free = plan_placement(PlanRequest(GRPO, models, WORK, cluster))  # a dry run told no backends: any layout
    assert any(lay.tp > 1 or lay.sharding is Sharding.SHARD_GRAD_OP for g in free.groups for lay in g.layouts)
    for backend in ("fsdp", "deepspeed"):
        plan = plan_placement(PlanRequest(GRPO, models, WORK, cluster, support=_support(backend)))
        for group in plan.groups:
            for layout in group.layouts:
                assert BACKENDS.get(backend).support.problems(layout) == [], (backend, layout)
                # The native rollout generates on the trained model: split as it is for training.
                assert layout.rollout_tp == layout.tp
        layouts = [lay for g in plan.groups for lay in g.layouts]
        # FSDP declares tensor parallelism (FSDP2 x TP), DeepSpeed does not: placement auto plans it on FSDP only.
        assert any(lay.tp > 1 for lay in layouts) is (backend == "fsdp"), layouts
    # Full replicas of an 8B model with Adam do not fit 80 GB: the torch backend's plan is refused by name.
    with pytest.raises(InfeasibleError, match=r"with the layouts backend 'torch' runs \(shardings \['NO_SHARD'\]"):
        plan_placement(PlanRequest(GRPO, models, WORK, cluster, support=_support("torch")))


def test_a_fixed_micro_batch_is_an_input_of_the_plan() -> None:
    cluster, models = Cluster.parse("8xA100-80G"), dict.fromkeys(ROLES, LLAMA)
    request = PlanRequest(GRPO, models, WORK, cluster, support=_support("fsdp"))
    chosen = plan_placement(request).layout("actor").micro_batch_size
    fixed = 2 if chosen != 2 else 4
    plan = plan_placement(PlanRequest(GRPO, models, WORK, cluster, support=_support("fsdp"),
                                      micro_batch_sizes={"actor": fixed}))
    assert plan.layout("actor").micro_batch_size == fixed
    with pytest.raises(ValueError, match=r"micro_batch_sizes\['actor'\]=0 must be a positive integer"):
        plan_placement(PlanRequest(GRPO, models, WORK, cluster, micro_batch_sizes={"actor": 0}))
    with pytest.raises(ValueError, match=r"micro_batch_sizes names \['critic'\]"):
        plan_placement(PlanRequest(GRPO, models, WORK, cluster, micro_batch_sizes={"critic": 4}))


def test_a_manual_mapping_fixed_outside_a_backend_is_refused_naming_it() -> None:
    cluster, models = Cluster.parse("4xA100-80G"), dict.fromkeys(ROLES, ModelSpec.preset("qwen2.5-0.5b"))
    mapping = {role: [0, 1, 2, 3] for role in ROLES}
    with pytest.raises(ValueError, match=r"that the roles' backends run .*actor: torch"):
        evaluate_mapping(PlanRequest(GRPO, models, WORK, cluster, support=_support("torch")), mapping,
                         sharding="FULL_SHARD")
    plan = evaluate_mapping(PlanRequest(GRPO, models, WORK, cluster, support=_support("torch")), mapping, sharding=None)
    assert {lay.sharding for g in plan.groups for lay in g.layouts} == {Sharding.NO_SHARD}


def test_layout_support_names_every_field_it_would_not_run() -> None:
    layout = RoleLayout(role="actor", dp=4, tp=2, sharding=Sharding.FULL_SHARD, rollout_tp=2, rollout_batch_size=8,
                        gradient_checkpointing=True)
    plain = LayoutSupport(backend="mine")
    problems = plain.problems(layout)
    assert [p.split("=")[0] for p in problems] == ["sharding", "tp", "rollout_tp", "rollout_batch_size",
                                                   "gradient_checkpointing"]
    assert plain.problems(layout, generates=False)[2].startswith("rollout_batch_size") is False
    assert ANY_LAYOUT.problems(layout) == []
    with pytest.raises(ValueError, match="must include NO_SHARD"):
        LayoutSupport(backend="odd", shardings=frozenset({Sharding.FULL_SHARD}))
    with pytest.raises(ValueError, match="offload has \\['gpu'\\]"):
        LayoutSupport(backend="odd", offload=frozenset({"gpu"}))


def _specs(graph, model: Path, backend: str = "torch") -> dict[str, RoleSpec]:
    return {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model), backend=backend,
                             optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
            for r in graph.roles if r.kind.needs_gpu}


class _Recording(LocalExecutor):
    started = False

    def start(self, plan, specs):  # type: ignore[no-untyped-def]
        type(self).started = True
        return super().start(plan, specs)


def test_the_controller_refuses_an_unrunnable_plan_before_any_engine_loads(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=4)
    layouts = (RoleLayout(role="actor", dp=2, sharding=Sharding.FULL_SHARD, dtype="fp32"),
               RoleLayout(role="reference", dp=2, dtype="fp32", rollout_tp=2))
    plan = Plan(algorithm="grpo", driver_roles=("reward",), groups=(GroupPlan(
        gpus=(0, 1), hosts=(0, 0), device="cpu", roles=("actor", "reference"), layouts=layouts,
        memory_per_gpu_bytes=0, capacity_bytes=0),))
    with pytest.raises(ValueError, match=r"role 'actor' \(backend 'torch'\): sharding=FULL_SHARD \(it runs NO_SHARD\); "
                                         r"use backend fsdp or deepspeed"):
        Controller(graph, plan, specs=_specs(graph, random_model_dir), executor=_Recording(),
                   driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)})
    assert not _Recording.started


def _engine_layouts(controller: Controller) -> dict[str, dict]:
    return {role: ran for group in controller.groups for info in group.info() for role, ran in info["layouts"].items()}


def test_placement_auto_runs_the_micro_batches_the_plan_recorded(tmp_path: Path, random_model_dir: Path) -> None:
    config = load_config(None, ["algorithm=grpo", "placement.mode=auto", "placement.cluster=2xCPU", "data.batch_size=4",
                                "algorithm.options={max_new_tokens: 4, n: 2}",
                                "roles={reference: {micro_batch_size: 3}}",
                                f"output_dir={tmp_path}", "logging.progress=false"])
    prepared = prepare_run(config)
    plan = prepared.plan
    assert plan.layout("reference").micro_batch_size == 3  # the user's value is an input of the plan
    specs = prepared.role_specs(str(random_model_dir))
    loader = PromptLoader(records=task_examples("reverse", 16), tokenizer=TOKENIZER, batch_size=4)
    with Controller(prepared.graph, plan, specs=specs, driver_roles={"reward": prepared.scorer}) as controller:
        ran = _engine_layouts(controller)
        for role in ("actor", "reference"):
            layout = plan.layout(role)
            assert ran[role]["micro_batch_size"] == layout.micro_batch_size
            assert ran[role]["forward_micro_batch_size"] == (layout.forward_micro_batch_size or layout.micro_batch_size)
            assert ran[role]["sharding"] == "NO_SHARD" == layout.sharding.value
        assert ran["actor"]["rollout_batch_size"] == plan.layout("actor").rollout_batch_size
        controller.step(loader.batch(0), step=0)


def test_a_plan_file_that_disagrees_with_a_fixed_micro_batch_is_refused(tmp_path: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    path = tmp_path / "plan.json"
    path.write_text(default_plan(graph, micro_batch_sizes={"actor": 8, "reference": 8}).to_json())
    config = load_config(None, [f"placement.plan_file={path}", "optim.actor.micro_batch_size=4"])
    with pytest.raises(ValueError, match=r"micro_batch_size\)=4 disagrees with the plan file's 8"):
        setup.build_plan(config, graph)
    assert setup.build_plan(load_config(None, [f"placement.plan_file={path}", "optim.actor.micro_batch_size=8"]), graph)


def test_generation_in_waves_of_the_plans_rollout_batch(random_model_dir: Path) -> None:
    from hybridflow.backends.torch import TorchRoleEngine

    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    rows = PromptLoader(records=task_examples("reverse", 8), tokenizer=TOKENIZER, batch_size=5).batch(0)
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model=str(random_model_dir))

    def generate(rollout_batch: int, greedy: bool):  # type: ignore[no-untyped-def]
        context = WorkerContext(group=0, rank=0, world_size=1, device="cpu", collective=SoloCollective())
        engine = TorchRoleEngine(spec, RoleLayout(role="actor", dp=1, dtype="fp32",
                                                  rollout_batch_size=rollout_batch), context)
        return engine.generate(rows, SamplingParams(max_new_tokens=8, greedy=greedy, seed=3))

    whole, waves = generate(0, True), generate(2, True)
    assert len(waves) == 5 and waves["responses"].shape == whole["responses"].shape
    assert bool((waves["responses"] == whole["responses"]).all())  # greedy: waves change nothing but memory
    sampled = generate(2, False)
    assert bool((sampled["response_mask"].sum(dim=1) >= 1).all())


def test_one_default_response_cap() -> None:
    assert SamplingParams().max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    graph = load_graph("grpo")
    assert graph.max_new_tokens == graph.lone_generate.max_new_tokens == DEFAULT_MAX_NEW_TOKENS  # type: ignore[union-attr]
    assert load_graph("grpo", max_new_tokens=7).max_new_tokens == 7


def test_plan_cli_takes_backends_and_stays_torch_free_without_them() -> None:
    base = [sys.executable, "-m", "hybridflow.cli", "plan", "--algorithm", "grpo", "--cluster", "8xA100-80G",
            "--model", "llama3-8b"]
    done = subprocess.run([*base, "--backend", "actor=torch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "backend 'torch' runs" in done.stderr
    done = subprocess.run([*base, *(f"--backend={r}=fsdp" for r in ROLES), "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    plan = Plan.from_json(done.stdout)
    assert all(BACKENDS.get("fsdp").support.problems(lay) == [] for g in plan.groups for lay in g.layouts)
    bad = subprocess.run([*base, "--backend", "critic=torch"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "'critic' is not a GPU role" in bad.stderr


def test_a_rollouts_tensor_parallelism_is_its_engines() -> None:
    from hybridflow.runtime.checks import check_layouts
    from hybridflow.runtime.placement import with_rollout_specs

    graph = load_graph("grpo", reward_kind="reward_function")

    def group(roles: tuple[str, ...], gpus: tuple[int, ...], **fields: int) -> GroupPlan:
        layouts = tuple(RoleLayout(role=role, dp=len(gpus), dtype="fp32", **fields) for role in roles)
        return GroupPlan(gpus=gpus, hosts=(0,) * len(gpus), device="cpu", roles=roles, layouts=layouts,
                         memory_per_gpu_bytes=0, capacity_bytes=0)

    plan = Plan(algorithm="grpo", driver_roles=("reward",),
                groups=(group(("actor", "reference"), (0, 1)), group(("actor:rollout",), (2, 3), rollout_tp=2)))

    def specs(rollout: str) -> dict[str, RoleSpec]:
        return with_rollout_specs(plan, {r.name: RoleSpec(name=r.name, kind=r.kind, model="tiny-qwen2",
                                                          rollout=rollout if r.kind.trainable else "native")
                                         for r in graph.roles if r.kind.needs_gpu})

    check_layouts(graph, plan, specs("vllm"))  # a detached vLLM rollout runs its own tensor parallelism
    with pytest.raises(ValueError, match=r"role 'actor:rollout' \(backend 'torch'\): rollout_tp=2 \(its rollout "
                                         r"engine runs rollout_tp <= 1\)"):
        check_layouts(graph, plan, specs("native"))


def test_offload_reaches_the_layouts_and_the_search_keeps_to_what_the_backend_offloads() -> None:
    from hybridflow.planner import Offload, RunSettings

    cluster, models = Cluster.parse("4xA100-80G"), dict.fromkeys(ROLES, ModelSpec.preset("qwen2.5-0.5b"))
    settings = RunSettings(offload={"actor": Offload(params=True, grads=True, optimizer=True)})
    for backend in ("fsdp", "deepspeed"):
        plan = plan_placement(PlanRequest(GRPO, models, WORK, cluster, settings=settings, support=_support(backend)))
        actor = plan.layout("actor")
        assert actor.offloaded == {"params", "grads", "optimizer"} and plan.layout("reference").offloaded == set()
        assert BACKENDS.get(backend).support.problems(actor) == []
        if backend == "deepspeed" and actor.dp > 1:
            assert actor.sharding in (Sharding.ZERO3, Sharding.FULL_SHARD)  # ZeRO offloads parameters at stage 3


def test_the_run_config_offload_key_reaches_the_planner() -> None:
    from hybridflow.planner import Offload
    from hybridflow.train.placement import run_settings

    config = load_config(None, ["roles={actor: {backend: fsdp, offload: [params, grads, optimizer]}, "
                                "reference: {backend: deepspeed, options: {offload_optimizer: true}}}"])
    assert dict(run_settings(config, GRPO).offload) == {
        "actor": Offload(params=True, grads=True, optimizer=True), "reference": Offload(optimizer=True)}
    with pytest.raises(ValueError, match=r"config key 'roles.\*.offload'=\['gpu'\]: give a list of params"):
        load_config(None, ["roles={actor: {offload: [gpu]}}"])
