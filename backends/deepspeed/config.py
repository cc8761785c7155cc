"""The DeepSpeed JSON config of a role, built from its plan layout, optimizer spec and options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.protocols import OptimSpec, RoleSpec, parse_options

# FSDP names a plan may carry, mapped to the ZeRO stage that shards the same things.
ZERO_STAGES = {Sharding.NO_SHARD: 0, Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.SHARD_GRAD_OP: 2,
               Sharding.ZERO3: 3, Sharding.FULL_SHARD: 3, Sharding.HYBRID_SHARD: 3}


@dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions:
    """Role options (``RoleSpec.options``) of the DeepSpeed backend; any other key is refused.

    ``offload_optimizer``: keep optimizer states (and the step) on the CPU (ZeRO-Offload; stage >= 1). It
    needs DeepSpeed's own CPU Adam, JIT-compiled on first use (~75 s, cached in ``TORCH_EXTENSIONS_DIR``);
    otherwise a torch AdamW is handed to DeepSpeed and nothing but a comm op is compiled.
    ``ds_config``: entries merged over the generated config (escape hatch; it wins).
    """

    offload_optimizer: bool = False
    init_method: str | None = None
    timeout_s: float = 300.0
    ds_config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: RoleSpec) -> DeepSpeedOptions:
        return parse_options(cls, spec.options, role=spec.name, owner="deepspeed backend")


def zero_stage(layout: RoleLayout) -> int:
    """The ZeRO stage of ``layout``'s sharding; on one rank, where every stage holds the same bytes, the stage its
    offload needs (ZeRO-3 for parameters, ZeRO-1 for optimizer states and gradients)."""
    stage = ZERO_STAGES[layout.sharding]
    if layout.dp == 1 and layout.offload_params:
        return 3
    if layout.dp == 1 and (layout.offload_optimizer or layout.offload_grads):
        return max(stage, 1)
    return stage


def offloads_optimizer(layout: RoleLayout, options: DeepSpeedOptions) -> bool:
    """ZeRO-Offload: optimizer states, fp32 master weights and gradient partitions in host memory, the step on the
    CPU (the layout's ``offload_optimizer``/``offload_grads``, or the older option of that name)."""
    return options.offload_optimizer or layout.offload_optimizer or layout.offload_grads


def build_config(spec: RoleSpec, layout: RoleLayout, options: DeepSpeedOptions, *, micro_batch_size: int,
                 pin_memory: bool = False) -> dict[str, Any]:
    """The config ``deepspeed.initialize`` gets. Gradient accumulation is left to the caller
    (``managed_gradient_accumulation: false``): each ``step()`` ends however many micro batches it had.

    Offload (ZeRO-Offload / ZeRO-Infinity to CPU): ``offload_optimizer`` for the layout's optimizer states and
    gradients (stage >= 1), ``offload_param`` for its parameters (stage 3); ``pin_memory`` (page-locked host
    buffers, CUDA only) speeds the copies."""
    stage = zero_stage(layout)
    optim = spec.optim or OptimSpec()
    zero: dict[str, Any] = {"stage": stage}
    if offloads_optimizer(layout, options):
        if stage == 0:
            raise ValueError(f"role {spec.name!r}: offload_optimizer needs ZeRO stage >= 1, but the layout's "
                             f"sharding {layout.sharding.value} is stage 0; use ZERO1/ZERO2/ZERO3")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if layout.offload_params:
        if stage != 3:
            raise ValueError(f"role {spec.name!r}: offload_params needs ZeRO stage 3 (parameters partitioned), but "
                             f"the layout's sharding {layout.sharding.value} is stage {stage}; use ZERO3/FULL_SHARD")
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if layout.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif layout.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100}
    if offloads_optimizer(layout, options):
        config["optimizer"] = {"type": "AdamW", "params": {"lr": optim.lr, "betas": list(optim.betas),
                                                           "weight_decay": optim.weight_decay}}
    return {**config, **options.ds_config}
