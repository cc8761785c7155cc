"""The backend contract: capability protocols checked against the graph, typed options, engines closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import RoleLayout
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.executor import LocalExecutor
from hybridflow.runtime.protocols import capabilities_of

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()


def _grpo(**actor_options: Any) -> tuple[Any, dict[str, RoleSpec]]:
    # kl_coef 0: nothing reads a reference, so the graph has none (the spec below is left unused).
    graph = load_graph("grpo", n=4, reward_kind="reward_function", max_new_tokens=6, kl_coef=0.0)
    options = {"vocab_size": len(TOKENIZER)}
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=0.5), options={**options, **actor_options}),
             "reference": RoleSpec(name="reference", kind=RoleKind.FROZEN_POLICY, model="unused", backend=BACKEND,
                                   options=options)}
    return graph, specs


def _step(graph: Any, specs: dict[str, RoleSpec], executor: Any = None, num_gpus: int = 1) -> Any:
    loader = PromptLoader(records=task_examples("reverse", 32), tokenizer=TOKENIZER, batch_size=4)
    with Controller(graph, default_plan(graph, num_gpus=num_gpus), specs=specs, executor=executor,
                    driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)}) as controller:
        before = _table(controller)
        result = controller.step(loader.batch(0), step=0)
        after = _table(controller)
    return result, before, after


def _table(controller: Controller) -> Any:
    shipment = controller.groups[0].export_weights("actor", "fp32")
    if not isinstance(shipment, tuple):  # Ray: an object reference to the packed weights
        import ray

        shipment = ray.get(shipment)
    return shipment[0]["table"][1].copy()


def test_a_backend_written_from_the_protocols_runs_a_grpo_step_locally(tmp_path: Path) -> None:
    graph, specs = _grpo(closed_log=str(tmp_path / "closed"))
    result, before, after = _step(graph, specs, num_gpus=2)
    assert {"actor/loss", "actor/pg_loss"} <= set(result.metrics)
    assert (after != before).any()  # the update moved the bigram table
    # Every engine of both ranks was closed when the controller shut down.
    assert sorted((tmp_path / "closed").read_text().split()) == ["actor", "actor"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_backend_written_from_the_protocols_runs_a_grpo_step_on_ray(tmp_path: Path, ray_two_nodes: str) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor

    graph, specs = _grpo(closed_log=str(tmp_path / "closed"))
    result, before, after = _step(graph, specs, executor=RayExecutor(address=ray_two_nodes), num_gpus=2)
    assert "actor/loss" in result.metrics and (after != before).any()
    assert sorted((tmp_path / "closed").read_text().split()) == ["actor", "actor"]


def test_a_missing_capability_names_the_role_the_op_and_the_protocol() -> None:
    graph, specs = _grpo(trains=False)
    with pytest.raises(TypeError, match=r"role 'actor' runs op 'update', which needs .* Trainer capability"):
        _step(graph, specs)


def test_capabilities_of_a_reference_engine() -> None:
    from hybridflow.backends.torch import TorchRoleEngine

    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    spec = RoleSpec(name="reference", kind=RoleKind.FROZEN_POLICY, model="tiny-qwen2")
    context = WorkerContext(group=0, rank=0, world_size=1, device="cpu", collective=SoloCollective())
    engine = TorchRoleEngine(spec, RoleLayout(role="reference", dp=1, dtype="fp32"), context)
    assert {"Engine", "Generator", "LogProbModel", "WeightSource", "WeightSink"} <= capabilities_of(engine)


@pytest.mark.parametrize("backend", ["torch", "fsdp", "deepspeed"])
def test_unknown_backend_options_are_refused_with_the_valid_ones(backend: str) -> None:
    if backend == "deepspeed":
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    graph, _ = _grpo()
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model="tiny-qwen2", backend=backend,
                            options={"shard_sise": 2}) for name in graph.role_names if name != "reward"}
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with (pytest.raises(ValueError, match=r"unknown .* option\(s\) \['shard_sise'\]; valid options are"),
          Controller(graph, default_plan(graph), specs=specs, executor=LocalExecutor(),
                     driver_roles={"reward": scorer})):
        pass


def test_unknown_vllm_options_are_refused_before_an_engine_starts() -> None:
    from hybridflow.backends.vllm import VllmOptions

    with pytest.raises(ValueError, match=r"unknown vllm option\(s\) \['sleep'\]; valid options are \[.*sleep_level"):
        VllmOptions.parse({"sleep": 1}, "actor")


def test_rollout_options_of_a_rollout_that_takes_none_are_refused() -> None:
    graph, _ = _grpo()
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model="tiny-qwen2",
                            rollout_options={"sleep_level": 1} if name == "actor" else {})
             for name in graph.role_names if name != "reward"}
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with (pytest.raises(ValueError, match=r"rollout='native' takes no rollout_options, got \['sleep_level'\]"),
          Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": scorer})):
        pass


def test_an_unknown_rollout_engine_is_refused_naming_the_choices() -> None:
    from hybridflow.runtime.engines import build_engine
    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model="tiny-qwen2", rollout="sglang")
    ctx = WorkerContext(group=0, rank=0, world_size=1, device="cpu", collective=SoloCollective())
    names = r"unknown rollout engine 'sglang'; valid names: \[.*'hf_generate'.*'native'.*'vllm'"
    with pytest.raises(KeyError, match=names):
        build_engine(spec, RoleLayout(role="actor", dp=1), ctx)


def test_weights_of_the_minimal_backend_travel_as_numpy() -> None:
    from hybridflow.runtime.weights import state_from_wire, state_to_wire

    state = {"table": torch.randn(4, 4).to(torch.bfloat16)}
    assert torch.equal(state_from_wire(state_to_wire(state.items()))["table"], state["table"])


def test_a_plan_with_sequence_or_pipeline_parallel_layouts_is_refused() -> None:
    import dataclasses

    graph, specs = _grpo()
    plan = default_plan(graph, num_gpus=2)
    group = plan.groups[0]
    layouts = tuple(dataclasses.replace(layout, pp=2) if layout.role == "actor" else layout for layout in group.layouts)
    odd = dataclasses.replace(plan, groups=(dataclasses.replace(group, layouts=layouts),))
    with pytest.raises(ValueError, match=r"role 'actor' has \{'pp': 2\}"):
        Controller(graph, odd, specs=specs, driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)})
