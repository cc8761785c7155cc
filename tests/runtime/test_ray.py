"""The Ray executor across two simulated nodes: placement as planned, numpy on the wire, loud failures."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.planner import GroupPlan, Plan, RoleLayout
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, WorkerFailedError

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOKENIZER = char_tokenizer()


def _two_node_plan() -> Plan:
    def group(role: str, gpus: tuple[int, int], host: int) -> GroupPlan:
        return GroupPlan(gpus=gpus, hosts=(host, host), device="cpu", roles=(role,),
                         layouts=(RoleLayout(role=role, dp=2, dtype="fp32", micro_batch_size=8),),
                         memory_per_gpu_bytes=0, capacity_bytes=0)

    return Plan(algorithm="grpo", groups=(group("actor", (0, 1), 0), group("reference", (2, 3), 1)),
                driver_roles=("reward",))


def test_roles_run_on_their_planned_nodes_and_a_killed_worker_fails_fast(ray_two_nodes: str,
                                                                          random_model_dir: Path) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor, gpu_nodes

    graph = load_graph("grpo", n=2, reward_kind="reward_function", max_new_tokens=6)
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model=str(random_model_dir),
                            optim=OptimSpec(lr=1e-3) if name == "actor" else None) for name in ("actor", "reference")}
    loader = PromptLoader(records=task_examples("reverse", 32), tokenizer=TOKENIZER, batch_size=4)
    executor = RayExecutor(address=ray_two_nodes)
    with Controller(graph, _two_node_plan(), specs=specs, executor=executor,
                    driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)}) as controller:
        result = controller.step(loader.batch(0), step=0)
        assert len(result.batch) == 8 and "actor/loss" in result.metrics
        nodes = gpu_nodes()
        assert len(nodes) == 2
        for group, host in ((0, 0), (1, 1)):
            infos = controller.groups[group].info()
            assert [i["node_id"] for i in infos] == [nodes[host]] * 2, f"group {group} is not on host {host}"
            assert all(len(i["gpu_ids"]) == 1 for i in infos)
            assert len({i["gpu_ids"][0] for i in infos}) == 2, "two ranks share one GPU bundle"
            assert len({i["pid"] for i in infos}) == 2

        victim = executor.groups[1].actors[1]
        threading.Timer(0.2, lambda: ray.kill(victim)).start()  # dies mid-step
        start = time.perf_counter()
        with pytest.raises(WorkerFailedError, match="'reference' rank 1") as info:
            for step in range(1, 20):
                controller.step(loader.batch(step), step=step)
        assert info.value.role == "reference" and info.value.rank == 1
        assert time.perf_counter() - start < 20


def test_training_survives_a_dead_worker_by_resuming(ray_two_nodes: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor
    from hybridflow.train import setup
    from hybridflow.train.checkpoint import latest_checkpoint
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    config_path = Path(__file__).resolve().parents[2] / "configs" / "grpo_reverse.yaml"
    overrides = ["model.sft_steps=5", "data.batch_size=4", "data.num_examples=64", "algorithm.options.n=2",
                 "algorithm.options.max_new_tokens=6", "logging.progress=false", "logging.plot=false",
                 "executor.name=ray", f"executor.ray_address={ray_two_nodes}", "checkpoint.every=2", "output_dir=run"]
    monkeypatch.chdir(tmp_path)  # a relative output_dir must still reach the workers (they run elsewhere)
    executor = RayExecutor(address=ray_two_nodes)

    def kill_after_first_checkpoint() -> None:
        while latest_checkpoint(tmp_path / "run") is None:
            time.sleep(0.05)
        ray.kill(executor.groups[0].actors[0])

    threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
    with monkeypatch.context() as patch, pytest.raises(WorkerFailedError, match="rank 0"):
        patch.setattr(setup, "make_executor", lambda config: executor)
        train(load_config(config_path, ["steps=50", *overrides]))
    resumed = train(load_config(config_path, ["steps=6", *overrides]), resume=True)
    assert resumed.start_step >= 2 and resumed.history[-1]["step"] == 5
    steps = [json.loads(line)["step"] for line in resumed.metrics_path.read_text().splitlines()]
    assert steps == list(range(6))
