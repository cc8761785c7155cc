"""Hand-written plans the runtime tests share: a policy's trainer and its rollout on a logical GPU each."""

from __future__ import annotations

from hybridflow.planner import GroupPlan, Plan, RoleLayout


def one_gpu_group(gpu: int, role: str) -> GroupPlan:
    return GroupPlan(gpus=(gpu,), hosts=(0,), device="cpu", roles=(role,),
                     layouts=(RoleLayout(role=role, dp=1, dtype="fp32", micro_batch_size=16),),
                     memory_per_gpu_bytes=0, capacity_bytes=0)


def split_plan(algorithm: str = "grpo_no_ref") -> Plan:
    """``actor`` on GPU 0, its rollout (``actor:rollout``) on GPU 1, the reward function on the driver."""
    return Plan(algorithm=algorithm, groups=(one_gpu_group(0, "actor"), one_gpu_group(1, "actor:rollout")),
                driver_roles=("reward",))
