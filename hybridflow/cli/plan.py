"""``hybridflow plan``: a dry run of the placement planner (no GPU, no torch), optionally beside a manual mapping."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, InfeasibleError, ModelSpec, Plan, PlannerOptions, plan_placement

DEFAULTS: dict[str, Any] = {"algorithm": "ppo", "batch_size": 1024, "prompt_len": 512, "response_len": 512,
                            "reward_kind": "reward_model", "sharding": "FULL_SHARD", "unit": "auto"}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="plan role placement on a cluster (dry run, no GPU needed)")
    parser.add_argument("--algorithm", help="built-in name or path/file.py:function (default ppo)")
    parser.add_argument("--cluster", help="spec such as 8xA100-80G, 2x8xH100, 4xA100-80G+2xT4, or a YAML file")
    parser.add_argument("--model", action="append", default=[], metavar="ROLE=MODEL",
                        help="a preset (llama3-8b), config.json path or parameter count (7e9); repeat per role; "
                             "a bare MODEL applies to every role not named")
    parser.add_argument("--batch-size", type=int, help="prompts per step (default 1024)")
    parser.add_argument("--prompt-len", type=int, help="tokens per prompt (default 512)")
    parser.add_argument("--response-len", type=int, help="tokens per response (default 512)")
    parser.add_argument("--n-samples", type=int, help="responses per prompt (default: the graph's n)")
    parser.add_argument("--reward-kind", choices=("reward_model", "reward_function"),
                        help="reward as a network on GPUs or a rule on the driver (default reward_model)")
    parser.add_argument("--manual", help='a mapping to check, e.g. "actor=0-3,critic=0-3,reward=4-5,reference=4-5"')
    parser.add_argument("--data-parallel-size", type=int, help="manual mapping: DP size per role (tp = GPUs / dp)")
    parser.add_argument("--sharding", help="manual mapping: FSDP sharding (default FULL_SHARD; 'auto' lets the "
                                           "planner choose)")
    parser.add_argument("--unit", choices=("auto", "gpu", "machine"), help="search unit (default auto)")
    parser.add_argument("--max-tp", type=int, help="most tensor parallelism for training and forward passes "
                                                     "(1 for data-parallel-only backends; rollout not capped)")
    parser.add_argument("--separate-rollout", action="store_true", default=None,
                        help="also consider giving the policy's rollout GPUs of its own (weights shipped after each "
                             "update); kept only when faster. In --manual, name it as actor:rollout=6-7")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--config", help="YAML with any of these options (keys as flags with underscores; "
                                         "models: {role: model}); flags override it")
    parser.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    settings = dict(DEFAULTS)
    models: dict[str, str] = {}
    if args.config:
        import yaml

        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: expected a mapping of options")
        models.update({str(k): str(v) for k, v in (loaded.pop("models", None) or {}).items()})
        settings.update(loaded)
    for key, value in vars(args).items():
        if value is not None and key not in ("model", "config", "json", "run", "command"):
            settings[key] = value
    seen: set[str] = set()
    for item in args.model:
        role, sep, model = item.partition("=")
        key, value = (role.strip(), model.strip()) if sep else ("*", item.strip())
        if key in seen:
            raise ValueError(f"--model names role {key!r} twice; give each role one model")
        seen.add(key)
        models[key] = value
    settings["models"] = models
    return settings


def _models(graph_roles: list[str], gpu_roles: list[str], given: dict[str, str]) -> dict[str, ModelSpec]:
    unknown = sorted(set(given) - set(graph_roles) - {"*"})
    if unknown:
        raise ValueError(f"--model names roles {unknown} that the algorithm lacks; roles: {graph_roles}")
    specs = {}
    for role in gpu_roles:
        text = given.get(role, given.get("*"))
        if text is None:
            raise ValueError(f"no model for role {role!r}; add --model {role}=llama3-8b (or a bare --model MODEL)")
        specs[role] = ModelSpec.parse(text)
    return specs


def run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not settings.get("cluster"):
        raise ValueError("--cluster is required, e.g. --cluster 8xA100-80G")
    graph = load_graph(str(settings["algorithm"]), reward_kind=settings["reward_kind"])
    spec = str(settings["cluster"])
    cluster = Cluster.from_yaml(spec) if spec.endswith((".yaml", ".yml")) else Cluster.parse(spec)
    gpu_roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    models = _models(graph.role_names, gpu_roles, settings["models"])
    workload = Workload(batch_size=int(settings["batch_size"]), prompt_len=int(settings["prompt_len"]),
                        response_len=int(settings["response_len"]), n_samples=settings.get("n_samples"))
    try:
        options = PlannerOptions(unit=settings["unit"], separate_rollout=bool(settings.get("separate_rollout")),
                                 max_tp=settings.get("max_tp"))
        auto = plan_placement(graph, models, workload, cluster, options=options)
    except InfeasibleError as err:
        print(f"hybridflow plan: infeasible: {err}", file=sys.stderr)
        return 1
    manual = None
    if settings.get("manual"):
        from hybridflow.planner.manual import evaluate_mapping, parse_mapping

        sharding = settings.get("sharding")
        manual = evaluate_mapping(graph, models, workload, cluster, parse_mapping(str(settings["manual"])),
                                  data_parallel_size=settings.get("data_parallel_size"),
                                  sharding=None if sharding in (None, "auto") else str(sharding).upper())
    _print(auto, manual, as_json=args.json)
    return 0 if manual is None or manual.feasible else 1


def _print(auto: Plan, manual: Plan | None, *, as_json: bool) -> None:
    from hybridflow.planner.compare import compare_plans

    if as_json:
        data = auto.to_dict()
        if manual is not None:
            data["manual"] = manual.to_dict()
            data["comparison"] = compare_plans(auto, manual)
        print(json.dumps(data, indent=2))
        return
    from hybridflow.planner.report import render_plan

    render_plan(auto, "auto plan")
    if manual is not None:
        render_plan(manual, "manual mapping")
        print(compare_plans(auto, manual))
