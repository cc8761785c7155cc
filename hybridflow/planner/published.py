"""Published runs as planner inputs: a record in the format of ``published_runs.json`` becomes a graph,
models, workload, cluster, mapping and run settings, costed with :func:`evaluate_mapping`.

What a record leaves out is filled by a documented default (below, ``DEFAULTS``) or by the record's own
``hybridflow`` mapping of overrides (``prompt_len``, ``response_len_mean``, ``rollout_tp``, ...), which
is where a benchmark states its assumptions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.graph import Graph, GraphBuilder, RoleKind, Workload, load_graph
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.overlays import ControllerOverlay
from hybridflow.planner.plan import Plan
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.settings import Framework, Offload, RunSettings

# What a record does not say, assumed the same way for every run (override per record under "hybridflow").
DEFAULTS: dict[str, Any] = {
    "prompt_len": 256,  # mean prompt tokens: math/GSM8K prompts with a template run 100-300 tokens
    "response_mean_fraction": 0.25,  # mean response / cap when unpublished (reasoning RL runs average far below)
    "rollout_sleep": True,  # verl frees the engine's memory after generating (free_cache_engine)
    "gpu_memory_utilization": 0.5,  # verl's default rollout.gpu_memory_utilization
}
# verl timing keys -> the planner's node names in the built-in graphs.
PHASES = {"gen": "actor_generate", "old_log_prob": "actor_logprob", "ref": "reference_ref_logprob",
          "values": "critic_values", "update_critic": "critic_update", "update_actor": "actor_update"}
MODEL_NAMES = {"qwen2.5-math-7b": "qwen2.5-math-7b", "qwen3-30b-a3b": "qwen3-30b-a3b", "deepseek-v3": "deepseek-v3",
               "qwen2-7b": "qwen2-7b", "qwen2.5-7b": "qwen2.5-7b", "qwen3-8b": "qwen3-8b", "llama-3-8b": "llama3-8b",
               "qwen3.5-9b": "qwen3.5-9b"}


@dataclass(frozen=True, kw_only=True)
class MeasuredCase:
    """One measured run, ready to cost: planner inputs plus the measured seconds by phase or node."""

    id: str
    graph: Graph
    models: Mapping[str, ModelSpec]
    workload: Workload
    cluster: Cluster
    mapping: Mapping[str, tuple[int, ...]]
    layout: Mapping[str, Any]  # evaluate_mapping keyword arguments: the run's parallel layout
    micro_batch_sizes: Mapping[str, int] = field(default_factory=dict)  # per role, the run's rows per micro batch
    settings: RunSettings
    measured: Mapping[str, float]  # "step", verl phase names or graph node names -> seconds
    overlay: ControllerOverlay | None = None  # the framework's own costs (verl's controller traffic)
    stream_chunks: int = 1  # a sync step streamed in that many chunks (a hybridflow run's plan.json says)

    @property
    def device(self) -> str:
        return self.cluster.device_names[0]

    def plan(self, calibration: Calibration | None = None) -> Plan:
        request = PlanRequest(self.graph, self.models, self.workload, self.cluster, settings=self.settings,
                              calibration=calibration, micro_batch_sizes=self.micro_batch_sizes, overlay=self.overlay,
                              stream_chunks=self.stream_chunks)
        return evaluate_mapping(request, self.mapping, **self.layout)

    def predict(self, calibration: Calibration | None = None) -> dict[str, float]:
        """Predicted seconds for every measured key."""
        return predicted_phases(self.plan(calibration), self.measured)

    def worst_ratio(self, calibration: Calibration | None = None) -> float:
        """The largest predicted/measured ratio or its inverse over the measured keys."""
        return math.exp(log_error(self.predict(calibration), self.measured))


def predicted_phases(plan: Plan, measured: Mapping[str, float]) -> dict[str, float]:
    seconds = {node.node: node.seconds for node in plan.nodes}
    out = {}
    for key in measured:
        node = PHASES.get(key, key)
        if key == "step":
            out[key] = plan.step_time_s
        elif node in seconds:
            out[key] = seconds[node]
    return out


def model_for(record: Mapping[str, Any], override: str | None) -> ModelSpec:
    if override:
        return ModelSpec.parse(override)
    text = str(record.get("model", "")).lower()
    for needle, preset in MODEL_NAMES.items():
        if needle in text:
            return ModelSpec.preset(preset)
    params = float(record.get("params_b") or 0) * 1e9
    if params <= 0:
        raise ValueError(f"record {record.get('id')!r}: unknown model {record.get('model')!r} and no params_b; "
                         "add hybridflow.model (a preset or config.json path)")
    return ModelSpec.from_params(params, name=str(record.get("model")))


def device_name(record: Mapping[str, Any]) -> str:
    text = str(record["gpus"]["type"]).replace("NVIDIA", "").replace("AMD", "").strip()
    return text.split()[0]


def measured_times(record: Mapping[str, Any], workload: Workload, samples: int, gpus: int) -> dict[str, float]:
    """Published seconds; a throughput-only record's step is tokens / (tokens per GPU-second x GPUs)."""
    timings = {key: float(value) for key, value in (record.get("timings_s") or {}).items()
               if key == "step" or key in PHASES}
    rate = (record.get("throughput") or {}).get("perf_throughput_tokens_per_gpu_s")
    if "step" not in timings and rate:
        tokens = workload.batch_size * samples * (workload.prompt_len + workload.response_len)
        timings["step"] = tokens / (float(rate) * gpus)
    return timings


def case_from_record(record: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> MeasuredCase:
    """A :class:`MeasuredCase` from one record; ``overrides`` (or the record's "hybridflow") fill gaps."""
    _check_record(record)
    extra = {**DEFAULTS, **(record.get("hybridflow") or {}), **(overrides or {})}
    gpus = record["gpus"]
    cluster = Cluster.parse(f"{gpus['nodes']}x{gpus['gpus_per_node']}x{extra.get('device') or device_name(record)}")
    graph = _graph(record, bool(extra.get("rollout_logprobs")))
    samples = int(record.get("n") or 1)
    cap = int(extra.get("response_len_max") or record["response_len_max"])
    mean = extra.get("response_len_mean") or record.get("response_len_mean") or cap * extra["response_mean_fraction"]
    lengths = LengthDistribution.lognormal(mean=float(mean), max=float(cap))
    workload = Workload(batch_size=int(record["batch_prompts"]), prompt_len=int(extra["prompt_len"]),
                        response_len=max(1, round(lengths.mean)), n_samples=samples,
                        image_tokens=int(extra.get("image_tokens") or 0))
    model = model_for(record, extra.get("model"))
    roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    every = tuple(range(cluster.num_gpus))
    return MeasuredCase(id=str(record["id"]), graph=graph, models=dict.fromkeys(roles, model), workload=workload,
                         cluster=cluster, mapping=dict.fromkeys(roles, every), layout=_layout(record, extra),
                         micro_batch_sizes=_micro_batch_sizes(record, roles),
                         settings=_settings(record, extra, lengths, samples),
                         measured=measured_times(record, workload, samples, cluster.num_gpus),
                         overlay=overlay_for(record))


def _graph(record: Mapping[str, Any], rollout_logprobs: bool) -> Graph:
    """The record's algorithm: PPO with a critic, else GRPO with or without a reference. With ``rollout_logprobs``
    (verl's ``use_rollout_log_probs``, the fully-async default) GRPO's update takes the engine's log-probs of the
    sampled tokens as its old log-probs, so there is no old_log_prob pass."""
    reward_kind = "reward_model" if record.get("reward_model") else "reward_function"
    if record.get("critic"):
        if rollout_logprobs:
            raise ValueError(f"published run {record.get('id')!r}: hybridflow.rollout_logprobs is for GRPO records "
                             "(no critic)")
        return load_graph("ppo", reward_kind=reward_kind)
    reference = bool(record.get("reference_model"))
    if not rollout_logprobs:
        return load_graph("grpo" if reference else "grpo_no_ref", reward_kind=reward_kind)
    g = GraphBuilder("grpo_rollout_logprobs" if reference else "grpo_no_ref_rollout_logprobs")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", reward_kind)
    g.generate(actor, n=int(record.get("n") or 1), logprobs=True)
    g.score(reward)
    inputs: tuple[str, ...] = ("prompts", "responses", "response_mask", "rollout_logprobs")
    if reference:
        g.ref_logprob(g.role("reference", RoleKind.FROZEN_POLICY))
        inputs += ("ref_logprobs",)
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "response_mask", "uid"), outputs=("advantages",))
    g.update(actor, loss="ppo_policy", inputs=(*inputs, "advantages"))
    return g.build()


def _check_record(record: Mapping[str, Any]) -> None:
    """The fields every record needs, named with the record when missing."""
    name = record.get("id", "<no id>")
    for key in ("id", "gpus", "batch_prompts", "response_len_max"):
        if record.get(key) in (None, ""):
            raise ValueError(f"published run {name!r}: field {key!r} is missing; see the format of "
                             "published_runs.json (id, gpus{type,count,nodes,gpus_per_node}, batch_prompts, n, "
                             "response_len_max, timings_s)")
    for key in ("type", "count", "nodes", "gpus_per_node"):
        if not (record["gpus"] or {}).get(key):
            raise ValueError(f"published run {name!r}: field 'gpus.{key}' is missing")


def _layout(record: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """evaluate_mapping keywords from the record's parallelism (Megatron tp/pp/ep, Ulysses sp, fsdp_size)."""
    par = {**(record.get("train_parallelism") or {}), **(extra.get("train_parallelism") or {})}
    tp, pp = int(par.get("tp") or 1), int(par.get("pp") or 1)
    sp = int(par.get("ulysses_sp") or par.get("cp") or 1)
    gpus = int(record["gpus"]["count"])
    if gpus % (tp * pp * sp):
        raise ValueError(f"published run {record.get('id')!r}: {gpus} GPUs do not split into tp={tp} x pp={pp} x "
                         f"sp/cp={sp} slices; fix train_parallelism")
    # RoleLayout.dp counts every rank of a tensor-parallel slice (GPUs / tp); pipeline stages and sequence/context
    # parallel ranks split it, so the data-parallel ranks a batch is divided over are GPUs / (tp x pp x sp) and the
    # ranks a (distributed) optimizer shards over are GPUs / (tp x pp) (costs.shard_ranks).
    layout: dict[str, Any] = {"data_parallel_size": gpus // tp, "sequence_parallel": sp, "pipeline_parallel": pp,
                              "expert_parallel": int(par.get("ep") or 1)}
    rollout_tp = extra.get("rollout_tp") or record.get("rollout_tp")
    if rollout_tp:
        layout["rollout_tp"] = {"actor": int(rollout_tp)}
    backend = str(record.get("train_backend", "")).lower()
    if par.get("fsdp_size") and int(par["fsdp_size"]) < gpus // (tp * pp):
        layout["sharding"], layout["fsdp_size"] = "HYBRID_SHARD", int(par["fsdp_size"])
    elif "megatron" in backend:
        layout["sharding"] = "ZERO1"  # Megatron's distributed optimizer shards optimizer states over DP
    else:
        layout["sharding"] = "FULL_SHARD"
    checkpointing = extra.get("grad_checkpointing", record.get("grad_checkpointing"))
    layout["gradient_checkpointing"] = None if checkpointing is None else bool(checkpointing)
    return layout


def _micro_batch_sizes(record: Mapping[str, Any], roles: list[str]) -> dict[str, int]:
    """The run's rows per micro batch and GPU, per role (none under dynamic batching: token budgets cut them)."""
    micro = record.get("micro_batch") or {}
    if micro.get("use_dynamic_bsz"):
        return {}
    sizes = {"actor": micro.get("actor_ppo_micro_batch_size_per_gpu") or micro.get("ppo_micro_batch_size_per_gpu"),
             "critic": micro.get("critic_ppo_micro_batch_size_per_gpu")}
    return {role: int(size) for role, size in sizes.items() if size and role in roles}


def _settings(record: Mapping[str, Any], extra: Mapping[str, Any], lengths: LengthDistribution,
              samples: int) -> RunSettings:
    micro = record.get("micro_batch") or {}
    offload = record.get("offload") or {}
    roles = {"actor": "actor", "ref": "reference", "critic": "critic"}
    chosen = {}
    for prefix, role in roles.items():
        flags = {part: bool(offload.get(f"{prefix}_{part}")) for part in ("param", "grad", "optimizer")}
        if any(flags.values()):
            chosen[role] = Offload(params=flags["param"], grads=flags["grad"], optimizer=flags["optimizer"])
    mini = micro.get("ppo_mini_batch_prompts")
    dynamic = bool(micro.get("use_dynamic_bsz"))
    train_budget = micro.get("actor_ppo_max_token_len_per_gpu") if dynamic else None
    forward_budget = micro.get("log_prob_max_token_len_per_gpu") if dynamic else None
    if dynamic and extra.get("token_budget"):
        train_budget = train_budget or extra["token_budget"]
        forward_budget = forward_budget or extra["token_budget"]
    util = record.get("rollout_gpu_memory_utilization") or extra.get("gpu_memory_utilization")
    return RunSettings(lengths=lengths, padding=padded(record, extra),
                       mini_batch_size=int(mini) * samples if mini else None,
                       train_tokens_per_gpu=int(train_budget) if train_budget else None,
                       forward_tokens_per_gpu=int(forward_budget) if forward_budget else None,
                       offload=tuple(sorted(chosen.items())), framework=framework_of(record),
                       gpu_memory_utilization=float(util) if util else None,
                       rollout_sleep=bool(extra.get("rollout_sleep")), epochs=int(extra.get("epochs", 1)),
                       enforce_eager=_eager(record),
                       max_prompt_len=int(record["prompt_len_max"]) if record.get("prompt_len_max") else None,
                       **_step_terms(extra))


def framework_of(record: Mapping[str, Any]) -> Framework:
    """Where the record's framework runs a step unlike hybridflow (:class:`Framework`): how it moves offloaded
    state (:func:`trainable_offload`) and whether its rollout is verl's vendored V0 vLLM engine."""
    return Framework(name=str(record.get("framework") or "unnamed"), trainable_offload=trainable_offload(record),
                     vllm_v0_engine=_vllm_v0(record))


def trainable_offload(record: Mapping[str, Any]) -> str:
    """How the record's framework moves a trainable role's offloaded state (``Framework.trainable_offload``): verl's
    FSDP workers load it whole onto the GPU for each phase and offload it after (``per_phase``); any other framework
    as FSDP2's ``CPUOffloadPolicy`` or ZeRO-Offload run it (``per_unshard``), as hybridflow does."""
    return "per_phase" if "verl" in str(record.get("framework", "")).lower() else "per_unshard"


# What a measured step holds beyond its graph (``step_terms.py``), from a record's ``hybridflow`` mapping: the
# benchmark states each from the run's script (test_freq, save_freq, val_kwargs.n) and how its step was averaged.
STEP_TERM_KEYS = {"reward_workers": int, "validations_per_step": float, "validation_prompts": int,
                  "validation_samples": int, "checkpoints_per_step": float}


def _step_terms(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {key: kind(extra[key]) for key, kind in STEP_TERM_KEYS.items() if extra.get(key) is not None}


def padded(record: Mapping[str, Any], extra: Mapping[str, Any]) -> bool:
    """Whether the run's forward and update passes pad every row: verl's ``model.use_remove_padding: false``, as
    the record (top level or under ``micro_batch``) or its ``hybridflow`` overrides state it. A record that does
    not say is costed packed: every script behind these records sets ``use_remove_padding=True``."""
    for source in (extra, record, record.get("micro_batch") or {}):
        if source.get("use_remove_padding") is not None:
            value = source["use_remove_padding"]
            if not isinstance(value, bool):
                raise ValueError(f"published run {record.get('id')!r}: use_remove_padding={value!r} must be true "
                                 "or false")
            return not value
    return False


def overlay_for(record: Mapping[str, Any]) -> ControllerOverlay | None:
    """verl's trainer ships every call's whole padded batch through its single controller (``DataProto``), padded
    to the prompt and response caps: a :class:`ControllerOverlay` for verl's records, None otherwise."""
    return ControllerOverlay() if "verl" in str(record.get("framework", "")).lower() else None


# verl's rollout.enforce_eager default: True through 0.5 (ppo_trainer.yaml at v0.3.0.post0 and v0.4.1, rollout.yaml at
# v0.5.0: "Set enforce_eager=True when [free_cache_engine is] enabled"), False from 0.6.0 (rollout.yaml at v0.6.0).
VERL_EAGER_UNTIL = (0, 5)


def _eager(record: Mapping[str, Any]) -> bool:
    """verl's rollout ``enforce_eager`` (no CUDA graphs): as the record's engine note states it, else verl's
    default for the record's ``framework_version`` (``VERL_EAGER_UNTIL``); False when neither says."""
    stated = re.search(r"enforce_eager\s*[=:]?\s*(true|false)", str(record.get("rollout_engine", "")).lower())
    if stated:
        return stated.group(1) == "true"
    if "verl" not in str(record.get("framework", "")).lower():
        return False
    version = re.search(r"(\d+)\.(\d+)", str(record.get("framework_version") or ""))
    return version is not None and (int(version.group(1)), int(version.group(2))) <= VERL_EAGER_UNTIL


# The V0 vLLM engines verl vendors (verl/third_party/vllm: 0.3.1, 0.4.2, 0.5.4, 0.6.3, used by verl <= 0.3); from 0.7
# verl drives vLLM's own LLM with its sleep mode instead.
VLLM_VENDORED_BEFORE = (0, 7)


def _vllm_v0(record: Mapping[str, Any]) -> bool:
    """Whether the rollout is verl's vendored V0 vLLM engine (``Framework.vllm_v0_engine``): a verl record whose
    engine note names a vLLM release (``x.y.z``) before ``VLLM_VENDORED_BEFORE``."""
    engine = str(record.get("rollout_engine", "")).lower()
    version = re.search(r"(\d+)\.(\d+)\.\d+", engine)
    return ("verl" in str(record.get("framework", "")).lower() and "vllm" in engine and version is not None
            and (int(version.group(1)), int(version.group(2))) < VLLM_VENDORED_BEFORE)


def log_error(predicted: Mapping[str, float], measured: Mapping[str, float]) -> float:
    """Worst ratio (as ``|log|``) between predicted and measured seconds over the keys both have."""
    ratios = [abs(math.log(predicted[k] / measured[k])) for k in measured if predicted.get(k, 0) > 0]
    return max(ratios, default=0.0)
