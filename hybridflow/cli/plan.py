"""``hybridflow plan``: a dry run of the placement planner (no GPU, no torch), optionally beside a manual mapping."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from hybridflow.cli.plan_options import check_numbers, model_spec, with_images
from hybridflow.files import read_yaml
from hybridflow.graph import Workload, load_graph
from hybridflow.graph.loading import takes_option
from hybridflow.planner import (
    Cluster,
    InfeasibleError,
    LayoutSupport,
    ModelSpec,
    Plan,
    PlannerOptions,
    PlanRequest,
    plan_placement,
)
from hybridflow.planner.agents import AgentWorkload
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.devices import GB, device_from_mapping, parse_device
from hybridflow.planner.lora_costs import LoraPlan
from hybridflow.planner.plan import ROLLOUT_SUFFIX
from hybridflow.planner.problem import role_adapters, shareable_references
from hybridflow.planner.settings import RunSettings, settings_from_dict

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
    parser.add_argument("--image-tokens", type=int, help="visual tokens of a prompt's image beside its --prompt-len "
                                                         "text tokens, for a vision-language model (default 0)")
    parser.add_argument("--template-tokens", type=int,
                        help="tokens an LLM judge's template adds to each judge prompt beside the prompt and response "
                             "(default: the template's text at 4 characters a token; a run counts it with its "
                             "tokenizer; add a reference-guided template's ground truth)")
    parser.add_argument("--train-vision-tower", action="store_true", default=None,
                        help="updates train the vision tower too (default: frozen, forward only, as verl)")
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
    parser.add_argument("--pipeline", choices=("sync", "one_step_off", "async", "auto"),
                        help="execution mode costed (default sync): one_step_off overlaps a detached rollout's "
                             "generation of the next step with training; async streams generation continuously, "
                             "at most --max-staleness updates ahead; auto compares sync colocated, sync split, "
                             "one_step_off split and async split plans and keeps the fastest")
    parser.add_argument("--max-staleness", type=int, metavar="K",
                        help="async: policy updates the rollout may run ahead of the trainer (default: compare 1 "
                             "and 2)")
    parser.add_argument("--stream-chunks", type=int, metavar="M",
                        help="sync: the search costs each step unstreamed and streamed in M chunks and keeps the "
                             "faster; with --manual, the mapping's step streamed in M chunks")
    parser.add_argument("--lora", metavar="rank=R[,targets=all-linear|q_proj+v_proj][,...]",
                        help="the trainable policies train LoRA adapters: their gradients and optimizer states are the "
                             "adapter's, a reference with the policy's model runs on its engine with the adapter "
                             "disabled, and updates sync the adapter to vLLM (keys: rank, targets, dropout, "
                             "sync=adapter|merged, when=always|needed (needed: only when full fine-tuning fits "
                             "nowhere), reference=shared|own)")
    add_run_arguments(parser)
    add_agent_arguments(parser)
    parser.add_argument("--backend", action="append", default=[], metavar="ROLE=NAME",
                        help="plan only layouts that backend runs for ROLE (torch, fsdp, deepspeed, vllm or a "
                             "registered one; repeatable; actor:rollout for a detached rollout, which may also name a "
                             "rollout engine: actor:rollout=server plans vLLM servers behind a router). Default: any "
                             "layout")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--config", help="YAML with any of these options (keys as flags with underscores; "
                                         "models: {role: model}); flags override it. A `hybridflow train` config "
                                         "instead prints the plan that run would execute")
    parser.set_defaults(run=run)


def add_run_arguments(parser: Any) -> None:
    """Devices, network, response lengths and the step recipe (shared with ``hybridflow calibrate``)."""
    parser.add_argument("--device", action="append", default=None, metavar="KEY=VALUE,...",
                        help="define a device: name=X,memory_gb=96,bf16_tflops=148,hbm_gbs=4000,link_gbs=450"
                             "[,host_gbs=50,matmul_fraction=0.8]; repeatable; the cluster spec may then name it")
    parser.add_argument("--inter-node-gbs", type=float, help="inter-node bandwidth per GPU in GB/s (default 25)")
    parser.add_argument("--host-cores", type=int, help="logical CPU GPUs: the cores each host gives them, shared "
                                                      "when more GPUs are busy (default: a core each)")
    parser.add_argument("--max-response-len", type=int, help="response cap; lengths become a lognormal with mean "
                                                            "--response-len and this cap")
    parser.add_argument("--lengths-from", help="a run's metrics.jsonl to take response length mean and max from")
    parser.add_argument("--mini-batch-size", type=int, help="sequences per optimizer step (ppo_mini_batch_size x n)")
    parser.add_argument("--epochs", type=int, help="PPO epochs per step (default 1)")
    parser.add_argument("--train-tokens-per-gpu", type=int, help="dynamic batching budget of updates")
    parser.add_argument("--forward-tokens-per-gpu", type=int, help="dynamic batching budget of forward passes")
    parser.add_argument("--offload", action="append", default=None, metavar="ROLE=PARTS",
                        help="CPU offload of a role, e.g. actor=params+optimizer (parts: params, grads, optimizer)")
    parser.add_argument("--trainable-offload", choices=("per_unshard", "per_phase"), default=None,
                        help="how a trainable role's offload moves: per_unshard as hybridflow runs it (default; "
                             "FSDP2 CPUOffloadPolicy, ZeRO-Offload), per_phase as verl does")
    parser.add_argument("--gpu-memory-utilization", type=float, help="rollout engine's share of device memory")
    parser.add_argument("--max-num-seqs", type=int, help="rollout engine's cap on sequences in flight")
    parser.add_argument("--rollout-sleep", action="store_true", default=None,
                        help="the colocated engine frees its memory between rollouts (verl free_cache_engine)")
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="engine without CUDA graphs")
    parser.add_argument("--padding", action="store_true", default=None,
                        help="forward/update passes pad responses to the max (no remove-padding)")
    parser.add_argument("--calibration", help="a calibration file written by `hybridflow calibrate`")


def add_agent_arguments(parser: Any) -> None:
    """Inputs of multi-turn generate nodes (``environment`` set): hybridflow.planner.agents."""
    parser.add_argument("--agent-turns", metavar="DIST", help="turns per trajectory, e.g. fixed:2, empirical:1,2,3 "
                                                              "(default: half the node's max_turns)")
    parser.add_argument("--tool-latency", metavar="DIST", help="seconds per tool call, e.g. "
                                                               "lognormal:median=0.1,sigma=1.0 (default fixed:0)")
    parser.add_argument("--observation-tokens", type=float, help="mean tokens of one tool answer (default 0)")
    parser.add_argument("--agent-from", metavar="METRICS.jsonl", help="a run's metrics.jsonl to take turns, tool calls "
                                                                      "and tool latency from (flags override it)")


AGENT_FLAGS = {"agent_turns": "turns", "tool_latency": "tool_latency", "observation_tokens": "observation_tokens",
               "agent_from": "from"}


def agent_workload(settings: dict[str, Any]) -> AgentWorkload | None:
    """The agent inputs of merged config/CLI settings (None: none given)."""
    data = {key: settings[flag] for flag, key in AGENT_FLAGS.items() if settings.get(flag) is not None}
    return AgentWorkload.from_mapping(data, where="plan options") if data else None


RUN_KEYS = ("max_response_len", "lengths_from", "mini_batch_size", "epochs", "train_tokens_per_gpu",
            "forward_tokens_per_gpu", "offload", "trainable_offload", "gpu_memory_utilization", "max_num_seqs",
            "rollout_sleep", "enforce_eager", "padding", "max_prompt_len", "reward_workers", "validations_per_step",
            "validation_prompts", "validation_samples", "checkpoints_per_step")


def run_settings(settings: dict[str, Any], mean_response_len: int) -> RunSettings:
    """The step recipe from merged config/CLI settings; ``--offload actor=params+optimizer`` as a mapping."""
    data = {key: settings[key] for key in RUN_KEYS if settings.get(key) is not None}
    offload = data.get("offload")
    if isinstance(offload, list):
        pairs = {}
        for item in offload:
            role, sep, parts = str(item).partition("=")
            if not sep:
                raise ValueError(f"--offload {item!r}: write ROLE=PARTS, e.g. actor=params+optimizer")
            pairs[role.strip()] = parts
        data["offload"] = pairs
    return settings_from_dict(data, mean_response_len=mean_response_len, where="plan options")


def build_cluster(settings: dict[str, Any]) -> Cluster:
    """The cluster spec or YAML, with ``--device`` definitions, ``--inter-node-gbs`` and ``--host-cores``."""
    spec = str(settings["cluster"])
    devices = {}
    for text in [*(settings.get("device") or []), *(settings.get("devices") or [])]:
        device = parse_device(text) if isinstance(text, str) else device_from_mapping(text, where="devices")
        devices[device.name] = device
    inter = settings.get("inter_node_gbs")
    if inter is not None and (isinstance(inter, bool) or not isinstance(inter, int | float) or not inter > 0):
        raise ValueError(f"--inter-node-gbs={inter!r} must be a positive number of GB/s per GPU, e.g. 25")
    cores = settings.get("host_cores")
    if spec.endswith((".yaml", ".yml")):
        if devices or inter is not None or cores is not None:
            raise ValueError("--device, --inter-node-gbs and --host-cores do not apply to a cluster YAML; put "
                             "'devices:', 'inter_node_bandwidth_gbs:' and 'host_cores:' in the YAML")
        return Cluster.from_yaml(spec)
    return Cluster.parse(spec, devices=devices, inter_node_bandwidth=float(inter or 25) * GB, host_cores=cores)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    settings = dict(DEFAULTS)
    models: dict[str, str] = {}
    sources: dict[str, str] = {}  # role -> where its model was named
    if args.config:
        loaded = read_yaml(args.config, what="--config") or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: expected a mapping of options")
        models.update({str(k): str(v) for k, v in (loaded.pop("models", None) or {}).items()})
        sources.update({role: f"{args.config}: models.{role}={model}" for role, model in models.items()})
        settings.update(loaded)
        settings["from_file"] = set(loaded)
    for key, value in vars(args).items():
        if value is not None and key not in ("model", "config", "json", "run", "command", "device", "offload",
                                             "backend"):
            settings[key] = value
    for key in ("device", "offload"):  # repeatable flags add to the config's entries
        given = getattr(args, key, None)
        if given:
            current = settings.get(key) or []
            settings[key] = [*current, *given] if isinstance(current, list) else [current, *given]
    seen: set[str] = set()
    for item in args.model:
        role, sep, model = item.partition("=")
        key, value = (role.strip(), model.strip()) if sep else ("*", item.strip())
        if key in seen:
            raise ValueError(f"--model names role {key!r} twice; give each role one model")
        seen.add(key)
        models[key] = value
        sources[key] = f"--model {item.strip()}"
    settings["models"], settings["model_sources"] = models, sources
    return settings


LORA_WHEN_VALUES = ("always", "needed")
REFERENCE_VALUES = ("shared", "own")


def lora_options(value: Any) -> tuple[LoraPlan | None, str, bool]:
    """``--lora rank=16,...`` (or a plan config's ``lora:`` mapping) as (adapter, when, share the reference)."""
    if value is None:
        return None, "always", False
    data = dict(value) if isinstance(value, dict) else _pairs(str(value))
    when, reference = str(data.pop("when", "always")), str(data.pop("reference", "shared"))
    if when not in LORA_WHEN_VALUES:
        raise ValueError(f"--lora when={when!r} must be one of {list(LORA_WHEN_VALUES)} (needed: LoRA only when full "
                         "fine-tuning fits nowhere)")
    if reference not in REFERENCE_VALUES:
        raise ValueError(f"--lora reference={reference!r} must be one of {list(REFERENCE_VALUES)} (shared: a reference "
                         "with the policy's model runs on its engine, adapter disabled)")
    return LoraPlan.from_mapping(data, where="--lora"), when, reference == "shared"


def _pairs(text: str) -> dict[str, str]:
    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (piece.strip() for piece in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"--lora {text!r}: {item!r} must be KEY=VALUE, e.g. --lora rank=16,targets=q_proj+v_proj")
        pairs[key] = value
    return pairs


def backend_support(items: list[str], gpu_roles: list[str]) -> dict[str, LayoutSupport]:
    """``--backend ROLE=NAME`` as each role's :class:`LayoutSupport` (importing a backend loads its stack, so a
    dry run without the flag stays torch-free)."""
    from hybridflow.registry import BACKENDS, ROLLOUTS

    support = {}
    for item in items:
        role, sep, name = (part.strip() for part in item.partition("="))
        if not sep or not role or not name:
            raise ValueError(f"--backend {item!r} must look like ROLE=NAME, e.g. --backend actor=fsdp")
        if role not in gpu_roles and role.removesuffix(ROLLOUT_SUFFIX) not in gpu_roles:
            raise ValueError(f"--backend {item!r}: {role!r} is not a GPU role of the algorithm; GPU roles: {gpu_roles}")
        if role.endswith(ROLLOUT_SUFFIX) and name not in BACKENDS and name in ROLLOUTS:
            declared = getattr(ROLLOUTS.get(name), "support", None)  # a rollout engine: `server` plans a fleet
        else:
            declared = getattr(BACKENDS.get(name), "support", None)
        support[role] = declared if declared is not None else LayoutSupport(backend=name)
    return support


def _models(graph_roles: list[str], gpu_roles: list[str], given: dict[str, str],
            sources: dict[str, str] | None = None) -> dict[str, ModelSpec]:
    unknown = sorted(set(given) - set(graph_roles) - {"*"})
    if unknown:
        raise ValueError(f"--model names roles {unknown} that the algorithm lacks; roles: {graph_roles}")
    specs = {}
    for role in gpu_roles:
        text = given.get(role, given.get("*"))
        if text is None:
            raise ValueError(f"no model for role {role!r}; add --model {role}=llama3-8b (or a bare --model MODEL)")
        source = role if role in given else "*"
        specs[role] = model_spec(text, (sources or {}).get(source, f"--model {text}"))
    return specs


# Keys only a `hybridflow train` config has: a --config file with any of them is a run's config (its sections, and
# the flat keys of before them that hybridflow.train.migration still moves).
TRAIN_ONLY_KEYS = frozenset({"placement", "executor", "checkpoint", "validation", "logging", "agent", "data", "model",
                             "actor", "critic", "roles", "steps", "output_dir", "algorithm.options",
                             "meshes", "plan_file", "planner_settings"})


def is_train_config(path: str | None) -> bool:
    if not path:
        return False
    loaded = read_yaml(path, what="--config") or {}
    return isinstance(loaded, dict) and bool(TRAIN_ONLY_KEYS & set(loaded))


def run_config_plan(path: str, *, as_json: bool) -> int:
    """The plan `hybridflow train --config PATH` would run, made by the same code (prompt lengths from its data,
    the step recipe derived from its keys, its backends' layouts); nothing is trained or loaded."""
    from hybridflow.train.config import load_config
    from hybridflow.train.prepare import prepare_run

    plan = prepare_run(load_config(path)).plan
    _print(plan, None, as_json=as_json, title=f"the plan of {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if is_train_config(args.config):
        extra = sorted(key for key, value in vars(args).items() if value not in (None, [], False)
                       and key not in ("config", "json", "run", "command"))
        if extra:
            raise ValueError(f"--config {args.config} is a `hybridflow train` config: its plan is the run's; drop "
                             f"the other options {extra} (or override them in the file)")
        return run_config_plan(args.config, as_json=args.json)
    settings = _settings(args)
    if not settings.get("cluster"):
        raise ValueError("--cluster is required, e.g. --cluster 8xA100-80G")
    check_numbers(settings, config=args.config, from_file=settings.get("from_file", set()))
    name = str(settings["algorithm"])
    graph = load_graph(name, **({"reward_kind": settings["reward_kind"]} if takes_option(name, "reward_kind") else {}))
    cluster = build_cluster(settings)
    gpu_roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    models = with_images(_models(graph.role_names, gpu_roles, settings["models"], settings["model_sources"]),
                         settings, config=args.config, from_file=settings.get("from_file", set()))
    workload = Workload(batch_size=int(settings["batch_size"]), prompt_len=int(settings["prompt_len"]),
                        response_len=int(settings["response_len"]), n_samples=settings.get("n_samples"),
                        image_tokens=int(settings.get("image_tokens") or 0),
                        template_tokens=settings.get("template_tokens"))
    steps = run_settings(settings, workload.response_len)
    support = backend_support(args.backend, gpu_roles)
    calibration = Calibration.load(settings["calibration"]) if settings.get("calibration") else None
    agent = agent_workload(settings)
    lora, lora_when, share = lora_options(settings.get("lora"))
    shared = shareable_references(graph, models, role_adapters(graph, lora)) if share else {}
    try:
        request = PlanRequest(graph, models, workload, cluster, settings=steps, calibration=calibration,
                              support=support, agent=agent, lora=lora, shared_weights=shared,
                              pipeline=str(settings.get("pipeline") or "sync"),
                              max_staleness=settings.get("max_staleness"),
                              stream_chunks=int(settings.get("stream_chunks") or 1))
        options = PlannerOptions(unit=settings["unit"], separate_rollout=bool(settings.get("separate_rollout")),
                                 max_tp=settings.get("max_tp"), lora_when=lora_when)
        auto = plan_placement(request, options)
    except InfeasibleError as err:
        print(f"hybridflow plan: infeasible: {err}", file=sys.stderr)
        return 1
    manual = None
    if settings.get("manual"):
        from hybridflow.planner.manual import evaluate_mapping, parse_mapping

        sharding = settings.get("sharding")
        mapping = parse_mapping(str(settings["manual"]))
        # A reference the mapping puts on GPUs of its own keeps its own copy.
        kept = {guest: host for guest, host in shared.items()
                if sorted(mapping.get(guest, mapping.get(host, ()))) == sorted(mapping.get(host, ()))}
        manual = evaluate_mapping(replace(request, shared_weights=kept), mapping,
                                  data_parallel_size=settings.get("data_parallel_size"),
                                  sharding=None if sharding in (None, "auto") else str(sharding).upper())
    _print(auto, manual, as_json=args.json)
    return 0 if manual is None or manual.feasible else 1


def _print(auto: Plan, manual: Plan | None, *, as_json: bool, title: str = "auto plan") -> None:
    from hybridflow.planner.compare import compare_plans

    if as_json:
        data = auto.to_dict()
        if manual is not None:
            data["manual"] = manual.to_dict()
            data["comparison"] = compare_plans(auto, manual)
        print(json.dumps(data, indent=2))
        return
    from hybridflow.planner.report import render_plan

    render_plan(auto, title)
    if manual is not None:
        render_plan(manual, "manual mapping")
        print(compare_plans(auto, manual))
