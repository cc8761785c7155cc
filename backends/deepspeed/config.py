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
    return ZERO_STAGES[layout.sharding]


def build_config(spec: RoleSpec, layout: RoleLayout, options: DeepSpeedOptions, *, micro_batch_size: int
                 ) -> dict[str, Any]:
    """The config ``deepspeed.initialize`` gets. Gradient accumulation is left to the caller
    (``managed_gradient_accumulation: false``): each ``step()`` ends however many micro batches it had."""
    stage = zero_stage(layout)
    optim = spec.optim or OptimSpec()
    zero: dict[str, Any] = {"stage": stage}
    if options.offload_optimizer:
        if stage == 0:
            raise ValueError(f"role {spec.name!r}: options.offload_optimizer needs ZeRO stage >= 1, but the layout's "
                             f"sharding {layout.sharding.value} is stage 0; use ZERO1/ZERO2/ZERO3")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
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
    if options.offload_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": optim.lr, "betas": list(optim.betas),
                                                           "weight_decay": optim.weight_decay}}
    return {**config, **options.ds_config}
