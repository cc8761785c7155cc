"""4xA100 + 2xT4: the planner places the roles, and a CPU rehearsal runs that exact plan.

The plan is made for production sizes (a 7B actor and reference, a 1.5B reward model) on a mixed
cluster; the rehearsal executes the same groups, devices and dtypes (replicas, capped micro batches) with tiny
models on logical GPUs, so the mapping is exercised end to end before any GPU is booked.

    .venv/bin/python examples/heterogeneous.py
"""

from dataclasses import replace
from pathlib import Path

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec, Plan, RoleLayout, Sharding, plan_placement
from hybridflow.planner.request import PlanRequest
from hybridflow.train.config import (
    AlgorithmConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    PlacementConfig,
    TrainConfig,
)
from hybridflow.train.loop import train


def rehearsal(plan: Plan) -> Plan:
    """The plan as the CPU's torch backend runs it: training and rollout tensor parallelism become data
    parallelism, shards become replicas, micro batches are capped at 16 rows (the tiny batch).

    Groups, GPUs, devices and dtypes are the plan's own.
    """
    def cpu(lay: RoleLayout) -> RoleLayout:
        return replace(lay, dp=lay.dp * lay.tp, tp=1, rollout_tp=1, sharding=Sharding.NO_SHARD,
                       micro_batch_size=min(lay.micro_batch_size, 16))

    groups = tuple(replace(group, layouts=tuple(cpu(lay) for lay in group.layouts)) for group in plan.groups)
    return replace(plan, groups=groups)


def main(output_dir: str = "runs/heterogeneous", steps: int = 3) -> None:
    graph = load_graph("grpo", n=4, max_new_tokens=8)
    models = {"actor": ModelSpec.preset("qwen2.5-7b"), "reference": ModelSpec.preset("qwen2.5-7b"),
              "reward": ModelSpec.preset("qwen2.5-1.5b")}
    plan = plan_placement(PlanRequest(graph, models, Workload(batch_size=512, prompt_len=512, response_len=1024),
                                      Cluster.parse("4xA100-80G+2xT4")))
    for group in plan.groups:
        layouts = ", ".join(f"{lay.role}: {lay.dtype} mbs={lay.micro_batch_size} dp={lay.dp}" for lay in group.layouts)
        print(f"GPUs {list(group.gpus)} ({group.device}): {layouts}")
    run_dir = Path(output_dir)
    plan_file = run_dir.with_name(f"{run_dir.name}_plan.json")  # beside the run: a new run's directory starts empty
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(rehearsal(plan).to_json())
    config = TrainConfig(algorithm=AlgorithmConfig(name="grpo", options={"n": 4, "max_new_tokens": 8,
                                                                         "reward_kind": "reward_model"}),
                         steps=steps, placement=PlacementConfig(num_gpus=plan.num_gpus, plan_file=str(plan_file)),
                         model=ModelConfig(sft_steps=20), data=DataConfig(task="reverse", batch_size=4),
                         output_dir=str(run_dir), logging=LoggingConfig(trackers=[], progress=False, plot=False))
    result = train(config)
    print(f"ran {len(result.history)} steps following the plan; metrics in {result.metrics_path}")


if __name__ == "__main__":
    main()
