"""The vLLM engine of a role: a frozen policy served by vLLM (backend ``vllm``), and the ``vllm`` rollout
(a standalone detached rollout, or a policy's trainer generating on vLLM through a hybrid engine)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hybridflow.backends.common.hybrid import HybridEngine
from hybridflow.backends.vllm.rollout import RolloutConfig, VllmRollout, materialize_model
from hybridflow.backends.vllm.turns import TurnLoop

from hybridflow.graph import RoleKind
from hybridflow.planner import LayoutSupport, RoleLayout
from hybridflow.planner.lora_costs import SYNC_MODES, adapter_sync_refusal
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import (
    AdapterSpec,
    Engine,
    GenerateBatch,
    RoleSpec,
    SamplingParams,
    WorkerContext,
    parse_options,
)
from hybridflow.runtime.weights import WeightSyncStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class VllmOptions:
    """Options of a vLLM engine: ``RoleSpec.options`` of a ``vllm``-backend role, ``RoleSpec.rollout_options``
    of a policy with ``rollout: vllm`` (its detached rollout takes the same). Any other key is refused.

    ``rollout_dtype``: the engine's dtype (default: the layout's). ``sleep_level``: put the engine to sleep
    after each generation (1 offloads weights and drops the KV cache, 2 drops both; 0 never sleeps) so a
    colocated trainer gets the memory back. ``engine_args``: extra ``vllm.LLM`` keyword arguments.

    A LoRA policy (``RoleSpec.lora``): ``lora_sync`` ``adapter`` sends only the adapter per update (vLLM's
    ``enable_lora``, the base loaded once), ``merged`` the merged whole weights; unset, the adapter when vLLM can
    take it (:func:`~hybridflow.planner.lora_costs.adapter_sync_refusal`), else merged; the planner costs the
    same. ``lora_versions``: adapter versions kept loaded (vLLM's ``max_loras``); unset, the role's
    ``policy_versions`` (k+1 for the run's staleness bound k, from the execution mode), and never fewer.
    """

    rollout_dtype: str | None = None
    kv_cache_gib: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 0
    lora_sync: str | None = None
    lora_versions: int | None = None
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, Any], role: str) -> VllmOptions:
        parsed = parse_options(cls, options, role=role, owner="vllm")
        if parsed.sleep_level not in (0, 1, 2):
            raise ValueError(f"role {role!r}: vllm option sleep_level={parsed.sleep_level} must be 0, 1 or 2")
        if parsed.lora_sync is not None and parsed.lora_sync not in SYNC_MODES:
            raise ValueError(f"role {role!r}: vllm option lora_sync={parsed.lora_sync!r} must be one of "
                             f"{list(SYNC_MODES)} or unset")
        if parsed.lora_versions is not None and (isinstance(parsed.lora_versions, bool) or not isinstance(
                parsed.lora_versions, int) or parsed.lora_versions < 1):
            raise ValueError(f"role {role!r}: vllm option lora_versions={parsed.lora_versions!r} must be an integer "
                             ">= 1 (k+1 for a staleness bound k) or unset (the run's k+1)")
        return parsed

    def adapter_versions(self, spec: RoleSpec) -> int:
        """Adapter versions to keep loaded: ``lora_versions``, else ``spec.policy_versions`` (k+1); a value below
        k+1 is refused (an in-flight trajectory would lose the adapter it started with)."""
        if self.lora_versions is None:
            return spec.policy_versions
        if self.lora_versions < spec.policy_versions:
            raise ValueError(f"role {spec.name!r}: rollout_options.lora_versions={self.lora_versions} keeps fewer "
                             f"adapter versions than may be generating at once ({spec.policy_versions}: the run's "
                             f"staleness bound k={spec.policy_versions - 1}, plus one); set lora_versions >= "
                             f"{spec.policy_versions} or leave it unset")
        return self.lora_versions

    def adapter_sync(self, spec: RoleSpec, trainer: Any) -> bool:
        """Whether ``trainer``'s updates reach vLLM as adapters alone; raises when ``lora_sync: adapter`` asks
        for what vLLM cannot take, and falls back to merged weights (logged) when unset."""
        has_adapters = spec.lora is not None and getattr(trainer, "has_adapters", False)
        return self.takes_adapter(spec.name, spec.lora if has_adapters else None)

    def takes_adapter(self, role: str, lora: AdapterSpec | None) -> bool:
        """Whether the updates of a policy training ``lora`` (None: none) reach this vLLM engine as the adapter
        alone, by :meth:`adapter_sync`'s rule (``role``: the policy, or its detached rollout)."""
        if lora is None:
            if self.lora_sync == "adapter":
                raise ValueError(f"role {role!r}: rollout_options.lora_sync=adapter, but the role trains no "
                                 "LoRA adapters (give it a lora spec or drop lora_sync)")
            return False
        if self.lora_sync == "merged":
            return False
        refusal = adapter_sync_refusal(init=lora.init, target_modules=lora.target_modules,
                                       sleep_level=self.sleep_level)
        if refusal is None:
            return True
        if self.lora_sync == "adapter":
            raise ValueError(f"role {role!r}: rollout_options.lora_sync=adapter is impossible: {refusal}; set "
                             "lora_sync: merged (the merged weights travel in full)")
        logger.warning("role %r: LoRA updates reach vLLM as merged whole weights: %s", role, refusal)
        return False

    def rollout_config(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext,
                       model_dir: str, *, lora_rank: int | None = None) -> RolloutConfig:
        return RolloutConfig(model_dir=model_dir, dtype=self.rollout_dtype or layout.dtype,
                             tensor_parallel_size=layout.rollout_tp, seed=spec.seed + context.rank,
                             device=context.device, max_model_len=self.max_model_len,
                             kv_cache_gib=self.kv_cache_gib, gpu_memory_utilization=self.gpu_memory_utilization,
                             lora_rank=lora_rank,
                             lora_versions=self.adapter_versions(spec) if lora_rank is not None else 1,
                             engine_args=self.bounded_args(layout))

    def bounded_args(self, layout: RoleLayout) -> dict[str, Any]:
        """``engine_args``, with the plan's bound on sequences in flight (``rollout_batch_size``) as vLLM's
        ``max_num_seqs`` unless the user set one."""
        args = dict(self.engine_args)
        if layout.rollout_batch_size:
            args.setdefault("max_num_seqs", layout.rollout_batch_size)
        return args


def start_rollout(spec: RoleSpec, options: VllmOptions, layout: RoleLayout, context: WorkerContext, *,
                  lora_rank: int | None = None) -> tuple[VllmRollout, Any]:
    """A rollout engine for ``spec``'s model (with ``lora_rank``: LoRA enabled over it as the base); returns it
    and the owner of any temporary model dir."""
    model_dir, holder = materialize_model(spec.model, seed=spec.seed)
    return VllmRollout(options.rollout_config(spec, layout, context, model_dir, lora_rank=lora_rank)), holder


def sample_seed(sampling: SamplingParams, rank: int) -> int:
    """Base seed of a generate call: ranks and steps sample differently, reruns the same."""
    # Row i samples with seed base + i (vLLM seeds per request): spacing the bases keeps ranks apart.
    return sampling.rank_seed(rank) * 100_003


class VllmRoleEngine:
    """``spec``'s model on vLLM: a frozen policy (reference, or a rollout fed weights from a trainer on another
    group), or the rollout half of a policy's hybrid engine. It trains nothing. With ``lora_rank`` it takes
    LoRA adapters (:meth:`load_adapter`) over its model as the base."""

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, options: VllmOptions, *,
                 lora_rank: int | None = None) -> None:
        self.spec, self.context, self.options = spec, context, options
        self.rollout, self._model_dir = start_rollout(spec, self.options, layout, context, lora_rank=lora_rank)
        self.last_sync: WeightSyncStats | None = None

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return self.rollout.generate(batch, sampling, seed=sample_seed(sampling, self.context.rank))

    @contextlib.contextmanager
    def turn_session(self, sampling: SamplingParams) -> Iterator[GenerateBatch]:
        """Agent turns (:class:`~hybridflow.runtime.protocols.TurnGenerator`) on the running engine: every request
        is a vLLM request of its own, and requests from concurrent callers share the engine's running batch
        (:class:`~hybridflow.backends.vllm.turns.TurnLoop`); results carry :attr:`weights_version`."""
        loop = TurnLoop(self.rollout.llm, sampling, eos_id=self.rollout.eos_id, version=self.weights_version,
                        lora_request=self.rollout.lora_request)
        try:
            yield loop  # callable, and concurrent calls join the running batch (continuous batching)
        finally:
            loop.close()

    @property
    def weights_version(self) -> int:
        """How many times new weights were loaded into the engine (0: the weights it started from)."""
        return self.rollout.weights_version

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        if with_entropy:
            raise ValueError(f"role {self.spec.name!r}: vLLM returns no entropy; ask log_probs(with_entropy=False)")
        return self.rollout.log_probs(batch)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights (HF names, e.g. a trainer's whole weights) into the running engine."""
        self.last_sync = self.rollout.load_weights(named)

    def load_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> None:
        """A new LoRA adapter version (peft names, peft config) over the base; generations after it use it."""
        self.last_sync = self.rollout.load_adapter(named, config)

    @property
    def takes_adapters(self) -> bool:
        """Whether the engine was started with LoRA (it then takes :meth:`load_adapter`, else whole weights)."""
        return self.rollout.adapters is not None

    @property
    def needs_weights(self) -> bool:
        """True after a level-2 sleep, which discarded the weights."""
        return self.rollout.needs_weights

    def sleep(self, level: int = 1) -> None:
        self.rollout.sleep(level)

    def wake_up(self) -> None:
        self.rollout.wake_up()

    def close(self) -> None:
        """Stop the engine (in process this also tears down torch.distributed's default group)."""
        self.rollout.shutdown()


class VllmBackend:
    """Builds :class:`VllmRoleEngine` s from ``RoleSpec.options``; ``BACKEND`` is what the registry finds."""

    name = "vllm"
    support = LayoutSupport(backend="vllm", max_rollout_tp=None, rollout_batch_size=True,
                            notes={"sharding": "a vLLM engine holds whole weights per tensor-parallel slice",
                                   "gradient_checkpointing": "a vLLM role does not train"})

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> VllmRoleEngine:
        if spec.kind is not RoleKind.FROZEN_POLICY:
            raise ValueError(f"role {spec.name!r} is a {spec.kind.value}: the vllm backend serves frozen policies "
                             "only; give a trainable policy backend fsdp/deepspeed/torch with rollout: vllm")
        return VllmRoleEngine(spec, layout, context, VllmOptions.parse(spec.options, spec.name))


class VllmRolloutFactory:
    """The ``vllm`` rollout, configured by ``RoleSpec.rollout_options`` (:class:`VllmOptions`).

    Standalone: a frozen policy with ``rollout: vllm`` (a policy's detached rollout) is a vLLM engine alone;
    the rollout of a LoRA policy (``RoleSpec.serves_adapter``) takes the adapter alone by the same rule
    (:meth:`VllmOptions.takes_adapter`), the controller shipping it instead of the merged weights.
    A trainable policy's trainer is wrapped in a :class:`HybridEngine` generating on a vLLM engine in the
    same process, weights handed over in place in the engine's dtype; a LoRA policy's, its adapter alone
    (:meth:`VllmOptions.adapter_sync`).
    """

    standalone = True
    max_rollout_tp = None  # vLLM's own tensor parallelism (``layout.rollout_tp``)
    support = VllmBackend.support  # a detached vLLM rollout runs what the vllm backend does

    def build(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, *,
              trainer: Engine | None) -> Engine:
        options = VllmOptions.parse(spec.rollout_options, spec.name)
        if trainer is None:
            adapter = spec.serves_adapter
            lora_rank = adapter.rank if adapter is not None and options.takes_adapter(spec.name, adapter) else None
            return VllmRoleEngine(spec, layout, context, options, lora_rank=lora_rank)
        if spec.kind is not RoleKind.POLICY:
            raise ValueError(f"role {spec.name!r} is a {spec.kind.value}: rollout: vllm applies to policies (a "
                             "trainable one generates through a hybrid engine, a frozen one is served by vLLM)")
        adapter_sync = options.adapter_sync(spec, trainer)
        lora_rank = spec.lora.rank if adapter_sync and spec.lora is not None else None
        rollout = VllmRoleEngine(spec, layout, context, options, lora_rank=lora_rank)
        return HybridEngine(trainer, rollout, weight_dtype=rollout.rollout.config.dtype,
                            sleep_level=options.sleep_level, adapter_sync=adapter_sync)


BACKEND = VllmBackend()
ROLLOUT = VllmRolloutFactory()
