"""Planner quality: modelled step time of the auto plan vs fixed placement strategies.

Strategies (all costed by the same model; layouts left to the planner's layout policy so only the
mapping differs): colocate-all (verl's default; every role on one device type, best type taken),
even split (OpenRLHF-style: each role an equal share, in GPU order within a type), and the seed's
manual mapping where the cluster has 8 GPUs. Run: ``python benchmarks/planner_quality.py [--json]
[--separate-rollout]`` (the latter lets the auto plan give the policy's rollout GPUs of its own).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass

from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec, Plan, PlannerOptions, Sharding, plan_placement
from hybridflow.planner.manual import evaluate_mapping, even_split_mapping, parse_mapping
from hybridflow.planner.problem import build_problem
from hybridflow.planner.request import PlanRequest

SEED_MAPPING = "actor=0-3,critic=0-3,reward=4-5,reference=4-5"


@dataclass(frozen=True)
class Case:
    name: str
    cluster: str
    algorithm: str
    models: dict[str, str]
    batch: int = 1024
    reward_kind: str = "reward_model"

    @property
    def mixed(self) -> bool:
        return len(Cluster.parse(self.cluster).device_names) > 1


LLAMA = dict.fromkeys(("actor", "critic", "reward", "reference"), "llama3-8b")
SUITE = (
    Case("seed: PPO 4x Llama-3-8B", "8xA100-80G", "ppo", LLAMA),
    Case("PPO 7B + 1.5B reward on A100+T4", "4xA100-80G+2xT4", "ppo",
         {"actor": "qwen2.5-7b", "critic": "qwen2.5-7b", "reference": "qwen2.5-7b", "reward": "qwen2.5-1.5b"}),
    Case("GRPO 1.5B + 0.5B reward on A100+T4", "4xA100-80G+2xT4", "grpo",
         {"actor": "qwen2.5-1.5b", "reference": "qwen2.5-1.5b", "reward": "qwen2.5-0.5b"}, batch=256),
    Case("PPO 4x Llama-3-8B on A100+L40S", "8xA100-80G+8xL40S", "ppo", LLAMA),
    Case("PPO 4x Llama-3-8B on H100+A100", "8xH100+8xA100-80G", "ppo", LLAMA),
    Case("GRPO 7B, rule reward, 2 nodes", "2x8xH100", "grpo", {"actor": "qwen2.5-7b", "reference": "qwen2.5-7b"},
         reward_kind="reward_function"),
    Case("PPO 70B actor/ref + 8B critic/reward", "4x8xA100-80G", "ppo",
         {"actor": "llama3-70b", "reference": "llama3-70b", "critic": "llama3-8b", "reward": "llama3-8b"}, batch=512),
)


def colocate_all(graph: Graph, models: dict[str, ModelSpec], workload: Workload, cluster: Cluster) -> Plan | None:
    """Every role on every GPU of one type; the best type for this case (infeasible types skipped)."""
    best = None
    for device in cluster.device_names:
        gpus = tuple(g for m in cluster.machines if m.device.name == device for g in m.gpu_ids)
        plan = evaluate_mapping(PlanRequest(graph, models, workload, cluster), dict.fromkeys(models, gpus),
                                sharding=None)
        if plan.feasible and (best is None or plan.step_time_s < best.step_time_s):
            best = plan
    return best


@dataclass(frozen=True)
class Row:
    case: str
    cluster: str
    mixed: bool
    auto_s: float
    fixed_s: dict[str, float | None]  # None: the strategy does not fit
    ratio_vs_best_fixed: float | None
    auto_groups: list[str]
    plan_seconds: float | None


def run_case(case: Case, options: PlannerOptions | None = None) -> Row:
    graph = load_graph(case.algorithm, reward_kind=case.reward_kind)
    models = {role: ModelSpec.preset(name) for role, name in case.models.items()}
    workload = Workload(batch_size=case.batch, prompt_len=512, response_len=512)
    cluster = Cluster.parse(case.cluster)
    auto = plan_placement(PlanRequest(graph, models, workload, cluster), options=options)
    fixed: dict[str, Plan | None] = {"colocate_all": colocate_all(graph, models, workload, cluster)}
    split = even_split_mapping(build_problem(graph, models, workload, cluster))
    request = PlanRequest(graph, models, workload, cluster)
    fixed["even_split"] = evaluate_mapping(request, split, sharding=None) if split else None
    if cluster.num_gpus == 8 and set(models) == {"actor", "critic", "reward", "reference"}:
        fixed["seed_manual"] = evaluate_mapping(PlanRequest(graph, models, workload, cluster),
                                                parse_mapping(SEED_MAPPING), sharding=Sharding.FULL_SHARD)
    times = {name: plan.step_time_s if plan is not None and plan.feasible else None for name, plan in fixed.items()}
    feasible = [t for t in times.values() if t is not None]
    best = min(feasible) if feasible else None
    return Row(case=case.name, cluster=case.cluster, mixed=case.mixed, auto_s=auto.step_time_s, fixed_s=times,
               ratio_vs_best_fixed=best / auto.step_time_s if best else None,
               auto_groups=[f"{'+'.join(g.roles)}@{g.size}x{g.device}" for g in auto.groups],
               plan_seconds=auto.search.seconds if auto.search else None)


def _cell(row: Row, strategy: str) -> str:
    if strategy not in row.fixed_s:
        return "-"
    value = row.fixed_s[strategy]
    return "OOM" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--separate-rollout", action="store_true", help="PlannerOptions(separate_rollout=True)")
    args = parser.parse_args(argv)
    options = PlannerOptions(separate_rollout=args.separate_rollout)
    rows = [run_case(case, options) for case in SUITE]
    mixed = [r.ratio_vs_best_fixed for r in rows if r.mixed and r.ratio_vs_best_fixed]
    mean_mixed = sum(mixed) / len(mixed) if mixed else float("nan")
    worst = min(r.ratio_vs_best_fixed or 1.0 for r in rows)
    if args.json:
        machine = f"{platform.machine()} python {platform.python_version()}"
        print(json.dumps({"machine": machine, "rows": [asdict(r) for r in rows],
                          "mean_ratio_mixed": mean_mixed, "min_ratio": worst}, indent=2))
        return 0
    print("| case | cluster | auto (s) | colocate-all (s) | even split (s) | seed manual (s) | best fixed / auto "
          "| auto groups |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(_cell(r, k) for k in ("colocate_all", "even_split", "seed_manual"))
        ratio = f"{r.ratio_vs_best_fixed:.2f}x" if r.ratio_vs_best_fixed else "-"
        print(f"| {r.case} | {r.cluster} | {r.auto_s:.1f} | {cells} | {ratio} | {', '.join(r.auto_groups)} |")
    print(f"\nmean ratio over mixed-GPU cases: {mean_mixed:.2f}x; worst ratio anywhere: {worst:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
