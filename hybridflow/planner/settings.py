"""How a run executes a step, beyond its placement: response lengths, PPO mini-batches, dynamic batching,
CPU offload, the rollout engine's memory and sleep/wake. These are the run's choices (verl's config keys
in brackets), not the planner's; the default is the plainest run (one optimizer step, no offload).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.planner.lengths import LengthDistribution


@dataclass(frozen=True, kw_only=True)
class Offload:
    """What a role keeps in host memory between its phases [``fsdp_config.param_offload`` ...]."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer


NO_OFFLOAD = Offload()

# How a trainable role's offloaded state travels (``Framework.trainable_offload``): hybridflow's way, FSDP2's
# ``CPUOffloadPolicy`` and ZeRO-Offload, or verl's swap around each phase.
TRAINABLE_OFFLOADS = ("per_unshard", "per_phase")


@dataclass(frozen=True, kw_only=True)
class Framework:
    """The framework a measured step ran on, where its step differs from hybridflow's in what the cost model
    prices. A published run's record states it (:func:`hybridflow.planner.published.framework_of`); hybridflow's
    own runs and plans keep :data:`HYBRIDFLOW`, so no other framework's ways leak into a plan of ours.

    - ``trainable_offload``: how a trainable role's offloaded state moves. ``per_unshard`` (as hybridflow's backends
      run it: FSDP2 ``CPUOffloadPolicy``, ZeRO-Offload): the parameter shard comes in at every unshard, the reduced
      gradients go out after every reduction and the optimizer steps on the host. ``per_phase`` (verl's FSDP
      workers, ``load_fsdp_model_to_gpu`` / ``offload_fsdp_model_to_cpu``): the state comes back whole for a phase
      and leaves after it.
    - ``vllm_v0_engine``: the rollout is the V0 vLLM engine verl vendors up to vLLM 0.6.3 (``verl/third_party/vllm``).
      Under ``enforce_eager`` its CPU work of a decode step (scheduling, input preparation, output processing) runs
      between its GPU steps, the GPU idle (vLLM turns async output processing off when eager;
      ``rollout.V0_SERIAL_STEP_CPU_S``); with ``rollout_sleep`` [``free_cache_engine``] it rebuilds its cache engine
      for every rollout, zeroing the KV cache and the CPU swap space again (``rollout.cache_rebuild_seconds``).
    """

    name: str = "hybridflow"
    trainable_offload: str = "per_unshard"
    vllm_v0_engine: bool = False

    def __post_init__(self) -> None:
        if self.trainable_offload not in TRAINABLE_OFFLOADS:
            raise ValueError(f"Framework.trainable_offload={self.trainable_offload!r} must be one of "
                             f"{list(TRAINABLE_OFFLOADS)}: per_unshard as hybridflow runs it (FSDP2 CPUOffloadPolicy, "
                             "ZeRO-Offload), per_phase as verl does")


HYBRIDFLOW = Framework()


MAX_EPOCHS = 100  # passes over one step's samples; PPO recipes use 1-10, and each pass is a whole update's work
MAX_STEP_ROWS = 1 << 22  # samples of one step: every step's tensors are sized by them before anything runs
MAX_SEQUENCE_TOKENS = 1 << 20  # prompt or response tokens: 1M, beyond the longest context of public models


def check_positive_int(owner: str, name: str, value: Any, *, allow_none: bool = True) -> None:
    """``owner.name=value must be a positive integer`` unless ``value`` is one (or None, with ``allow_none``)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer" + (" or None" if allow_none else ""))


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """A run's step recipe. Every field has a verl equivalent; ``None`` means "not used".

    - ``lengths``: response lengths; None means every response is ``Workload.response_len`` long.
      With a distribution, ``Workload.response_len`` should be its mean (the graph sizes edges with it).
    - ``padding``: forward and update passes see padded rows (every response at the max length)
      instead of packed ones [``use_remove_padding=False``].
    - ``mini_batch_size``: sequences per optimizer step [``ppo_mini_batch_size`` x ``n``]; ``epochs``
      [``ppo_epochs``]. None: the whole batch is one mini-batch.
    - ``train_tokens_per_gpu`` / ``forward_tokens_per_gpu``: dynamic batching budgets
      [``ppo_max_token_len_per_gpu``, ``log_prob_max_token_len_per_gpu``]; they replace row micro batches.
    - ``offload``: per role [``actor.fsdp_config.param_offload`` ...].
    - ``gpu_memory_utilization``: the rollout engine's share of device memory (weights + KV cache);
      None lets the planner size the engine's batch to fit. ``max_num_seqs``: the engine's cap on
      sequences in flight.
    - ``rollout_sleep``: a colocated engine frees its memory after generating and takes it back before
      the next rollout [``free_cache_engine``]; its weights travel over the host link both ways.
    - ``enforce_eager``: the engine decodes without CUDA graphs [``enforce_eager``]: every layer's kernels
      are launched from Python at every step.
    - ``framework``: where the step's framework differs from hybridflow's (:class:`Framework`; published runs only).
    - ``reward_workers``: processes a rule-based reward scores samples in (verl's reward managers: 1, the driver's
      loop; hybridflow's reward pool: its workers). ``validations_per_step``: validation passes a measured step
      holds on average [verl: 1 / ``test_freq`` inside its step timer; 0 when the step leaves them out] over
      ``validation_prompts`` x ``validation_samples`` rows [``val_kwargs.n``]; ``checkpoints_per_step``: the
      same for checkpoints [1 / ``save_freq``] (``step_terms.py``).
    - ``max_prompt_len``: the run's prompt cap [``data.max_prompt_length``] (None: the mean prompt); what a
      framework that pads batches to the caps ships (``overlays.ControllerOverlay``).
    """

    lengths: LengthDistribution | None = None
    padding: bool = False
    mini_batch_size: int | None = None
    epochs: int = 1
    train_tokens_per_gpu: int | None = None
    forward_tokens_per_gpu: int | None = None
    offload: tuple[tuple[str, Offload], ...] = ()
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 1024
    rollout_sleep: bool = False
    enforce_eager: bool = False
    framework: Framework = HYBRIDFLOW
    max_prompt_len: int | None = None
    reward_workers: int = 1
    validations_per_step: float = 0.0
    validation_prompts: int = 0
    validation_samples: int = 1
    checkpoints_per_step: float = 0.0
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        owner = "RunSettings"
        if isinstance(self.offload, Mapping):
            object.__setattr__(self, "offload", tuple(sorted(self.offload.items())))
        for name in ("mini_batch_size", "train_tokens_per_gpu", "forward_tokens_per_gpu", "max_prompt_len"):
            check_positive_int(owner, name, getattr(self, name))
        check_positive_int(owner, "epochs", self.epochs, allow_none=False)
        if self.epochs > MAX_EPOCHS:
            raise ValueError(f"{owner}.epochs={self.epochs} exceeds {MAX_EPOCHS} passes over a step's batch; use at "
                             f"most {MAX_EPOCHS} (PPO recipes use 1-10)")
        check_positive_int(owner, "max_num_seqs", self.max_num_seqs, allow_none=False)
        for name in ("reward_workers", "validation_samples"):
            check_positive_int(owner, name, getattr(self, name), allow_none=False)
        if not isinstance(self.validation_prompts, int) or isinstance(self.validation_prompts, bool) \
                or self.validation_prompts < 0:
            raise ValueError(f"{owner}.validation_prompts={self.validation_prompts!r} must be a count >= 0")
        for name in ("validations_per_step", "checkpoints_per_step"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
                raise ValueError(f"{owner}.{name}={rate!r} must be a rate in [0, 1] per step, e.g. 0.1 for every "
                                 "10th step")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"{owner}.gpu_memory_utilization={util!r} must be in (0, 1], e.g. 0.6")
        for role, value in self.offload:
            if not isinstance(value, Offload):
                raise TypeError(f"{owner}.offload[{role!r}] must be an Offload(params=..., grads=..., optimizer=...)")
        if self.lengths is not None and not isinstance(self.lengths, LengthDistribution):
            raise TypeError(f"{owner}.lengths must be a LengthDistribution, got {type(self.lengths).__name__}")

    def offload_of(self, role: str) -> Offload:
        """A role's offload; a detached rollout (``actor:rollout``) holds no trainer state to offload."""
        for name, value in self.offload:
            if name == role:
                return value
        return NO_OFFLOAD

    def response_lengths(self, mean_len: int) -> LengthDistribution:
        return self.lengths if self.lengths is not None else LengthDistribution.point(mean_len)


DEFAULT_SETTINGS = RunSettings()


# Keys of a run's step recipe in a plan config or on the CLI (``--max-response-len`` ...), with their meaning.
SETTING_KEYS = {
    "max_response_len": "the response length cap in tokens (lengths: lognormal with the mean response_len)",
    "lengths_from": "a run's metrics.jsonl to take the response length mean and max from",
    "padding": "true when forward/update passes pad every response to the max",
    "mini_batch_size": "sequences per optimizer step (verl ppo_mini_batch_size x n)",
    "epochs": "passes over the batch per step (verl ppo_epochs)",
    "train_tokens_per_gpu": "dynamic batching budget of update passes (ppo_max_token_len_per_gpu)",
    "forward_tokens_per_gpu": "dynamic batching budget of forward passes (log_prob_max_token_len_per_gpu)",
    "offload": "per role, what stays in host memory: {actor: [params, optimizer]} or actor=params+optimizer",
    "trainable_offload": "how a trainable role's offload moves: per_unshard (hybridflow: FSDP2 CPUOffloadPolicy, "
                         "ZeRO-Offload) or per_phase (verl's swap around each phase)",
    "gpu_memory_utilization": "the rollout engine's share of device memory, in (0, 1]",
    "max_num_seqs": "the rollout engine's cap on sequences in flight",
    "rollout_sleep": "true when the colocated engine frees its memory between rollouts",
    "enforce_eager": "true when the engine runs without CUDA graphs",
    "vllm_v0_engine": "true when the rollout is verl's vendored V0 vLLM engine (vLLM <= 0.6.3)",
    "max_prompt_len": "the prompt cap in tokens (the data's max_prompt_length)",
    "reward_workers": "processes scoring rule-based rewards (1: the driver's loop)",
    "validations_per_step": "validation passes per step, e.g. 0.1 for one every 10 steps",
    "validation_prompts": "validation prompts per validation pass",
    "validation_samples": "samples per validation prompt",
    "checkpoints_per_step": "checkpoints written per step, e.g. 0.05 for one every 20 steps",
}
_OFFLOAD_PARTS = {"params": "params", "param": "params", "grads": "grads", "grad": "grads",
                  "optimizer": "optimizer", "optim": "optimizer"}


def parse_offload(role: str, parts: Any, where: str) -> Offload:
    """``[params, optimizer]`` or ``"params+optimizer"`` as an :class:`Offload`."""
    items = parts.replace("+", ",").split(",") if isinstance(parts, str) else parts
    if not isinstance(items, list | tuple):
        raise ValueError(f"{where}.offload.{role}={parts!r}: give a list of {sorted(set(_OFFLOAD_PARTS.values()))}")
    chosen: dict[str, bool] = {}
    for item in items:
        key = _OFFLOAD_PARTS.get(str(item).strip().lower())
        if key is None:
            raise ValueError(f"{where}.offload.{role}: unknown part {item!r}; parts: params, grads, optimizer")
        chosen[key] = True
    return Offload(**chosen)


def _number(data: Mapping[str, Any], key: str, where: str, kind: type) -> Any:
    value = data[key]
    try:
        number = kind(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}.{key}={value!r} is not a {kind.__name__}: {SETTING_KEYS[key]}") from err
    if isinstance(value, bool) or number != float(value):
        raise ValueError(f"{where}.{key}={value!r} must be a {kind.__name__}: {SETTING_KEYS[key]}")
    return number


def settings_from_dict(data: Mapping[str, Any], *, mean_response_len: int, where: str = "settings") -> RunSettings:
    """A :class:`RunSettings` from plan-config keys (:data:`SETTING_KEYS`); errors name the key and the fix."""
    unknown = sorted(set(data) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(SETTING_KEYS)}")
    values: dict[str, Any] = {}
    for key in ("mini_batch_size", "epochs", "train_tokens_per_gpu", "forward_tokens_per_gpu", "max_num_seqs",
                "max_prompt_len", "reward_workers", "validation_prompts", "validation_samples"):
        if data.get(key) is not None:
            values[key] = _number(data, key, where, int)
    for key in ("gpu_memory_utilization", "validations_per_step", "checkpoints_per_step"):
        if data.get(key) is not None:
            values[key] = _number(data, key, where, float)
    traits: dict[str, Any] = {}
    for key in ("padding", "rollout_sleep", "enforce_eager", "vllm_v0_engine"):
        if data.get(key) is not None:
            if not isinstance(data[key], bool):
                raise ValueError(f"{where}.{key}={data[key]!r} must be true or false: {SETTING_KEYS[key]}")
            (traits if key == "vllm_v0_engine" else values)[key] = data[key]
    if data.get("trainable_offload") is not None:
        if data["trainable_offload"] not in TRAINABLE_OFFLOADS:
            raise ValueError(f"{where}.trainable_offload={data['trainable_offload']!r} must be one of "
                             f"{list(TRAINABLE_OFFLOADS)}: {SETTING_KEYS['trainable_offload']}")
        traits["trainable_offload"] = data["trainable_offload"]
    if traits:  # another framework's ways, stated to cost its run (a published record, a plan of verl's step)
        values["framework"] = Framework(name="stated", **traits)
    if data.get("lengths_from"):
        values["lengths"] = LengthDistribution.from_metrics(str(data["lengths_from"]))
    elif data.get("max_response_len") is not None:
        cap = _number(data, "max_response_len", where, int)
        if cap < mean_response_len:
            raise ValueError(f"{where}.max_response_len={cap} is below the mean response_len={mean_response_len}; "
                             "give the cap (the longest response allowed), at least the mean")
        values["lengths"] = LengthDistribution.lognormal(mean=mean_response_len, max=cap)
    offload = data.get("offload") or {}
    if not isinstance(offload, Mapping):
        raise ValueError(f"{where}.offload must map roles to parts, e.g. {{actor: [params, optimizer]}}")
    values["offload"] = tuple(sorted((str(role), parse_offload(str(role), parts, where))
                                     for role, parts in offload.items()))
    try:
        return RunSettings(**values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
