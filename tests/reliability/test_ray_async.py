"""``pipeline=async`` on Ray: a rollout worker killed mid-run is reported, and the run resumes from its
checkpoint with the trainer's and the rollout's state intact (what the dead worker generated after the
checkpoint is gone; what the checkpoint saved of the rollout's work is restored, not regenerated)."""

from __future__ import annotations

import filecmp
import os
import signal
from pathlib import Path

import pytest

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import ExecutionMode, GroupPlan, Plan, RoleLayout
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, WorkerFailedError
from hybridflow.runtime.liveness import Liveness

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

BACKEND = f"{Path(__file__).parents[1] / 'runtime' / 'minimal_backend.py'}:BACKEND"
TOKENIZER = char_tokenizer()
GRAPH = load_graph("grpo_no_ref", n=2, max_new_tokens=4, reward_kind="reward_function")
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)
FAST = Liveness(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0)


def _group(gpu: int, role: str) -> GroupPlan:
    return GroupPlan(gpus=(gpu,), hosts=(0,), device="cpu", roles=(role,),
                     layouts=(RoleLayout(role=role, dp=1, dtype="fp32", micro_batch_size=16),),
                     memory_per_gpu_bytes=0, capacity_bytes=0)


SPLIT = Plan(algorithm="grpo_no_ref", groups=(_group(0, "actor"), _group(1, "actor:rollout")), driver_roles=("reward",))


def _controller() -> Controller:
    from hybridflow.runtime.ray_executor import RayExecutor

    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=10.0), options={"vocab_size": len(TOKENIZER),
                                                                  "generate_delay_s": 0.05})}
    return Controller(GRAPH, SPLIT, specs=specs, executor=RayExecutor(liveness=FAST),
                      mode=ExecutionMode(pipeline="async", max_staleness=1, segment_tokens=2),
                      eos_token_id=-1,  # the bigram engine never stops early
                      driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)})


def _upcoming(step: int) -> object:
    return LOADER.batch(step)


def test_a_killed_rollout_worker_is_reported_and_the_run_resumes(local_ray: None, tmp_path: Path) -> None:
    with _controller() as controller:
        for step in range(3):
            controller.step(LOADER.batch(step), step=step, upcoming=_upcoming)
        controller.save_checkpoint(str(tmp_path / "saved"))
        pid = controller.groups[1].info()[0]["pid"]
        os.kill(pid, signal.SIGKILL)  # the rollout is generating step 3 (and 4) right now
        with pytest.raises(WorkerFailedError) as failed:
            for step in range(3, 30):
                controller.step(LOADER.batch(step), step=step, upcoming=_upcoming)
    assert failed.value.role == "actor:rollout" and failed.value.group == 1
    with _controller() as resumed:
        resumed.load_checkpoint(str(tmp_path / "saved"))
        resumed.save_checkpoint(str(tmp_path / "again"))  # the trainer's state, as loaded
        results = [resumed.step(LOADER.batch(step), step=step, upcoming=_upcoming) for step in range(3, 6)]
    saved, again = tmp_path / "saved", tmp_path / "again"
    files = sorted(p.relative_to(saved) for p in saved.rglob("*") if p.is_file())
    assert files and all(filecmp.cmp(saved / f, again / f, shallow=False) for f in files)
    # Step 3's rows were in flight at the checkpoint: tokens sampled before it keep version 2, the rest version 3.
    assert int(results[0].batch["policy_version"].min()) in (2, 3)
    assert all(r.metrics["pipeline/staleness_max"] <= 1 for r in results)
