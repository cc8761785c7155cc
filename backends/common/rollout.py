"""The rollouts every training backend offers (``RoleSpec.rollout``): ``native`` and ``hf_generate``.

Both sample with the role's own model (the trainer's, or a frozen copy's for a detached rollout): the
lean KV-cached loop, or HF ``generate``. They register in ``hybridflow.registry.ROLLOUTS`` when a training
backend imports; other rollout engines (vLLM, a plugin's) register there too and may wrap the trainer in
:class:`~hybridflow.backends.common.hybrid.HybridEngine`. docs/backends.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.backends.common.forward import ForwardOps

from hybridflow.planner import RoleLayout
from hybridflow.registry import ROLLOUTS
from hybridflow.runtime.protocols import Engine, RoleSpec, WorkerContext


def refuse_rollout_options(spec: RoleSpec) -> None:
    """A rollout that takes no options refuses any, naming where they belong."""
    if spec.rollout_options:
        raise ValueError(f"role {spec.name!r}: rollout={spec.rollout!r} takes no rollout_options, got "
                         f"{sorted(spec.rollout_options)}; drop them, or pick the rollout they configure "
                         f"(rollout: vllm for the vLLM engine's)")


def require_trainer(spec: RoleSpec, trainer: Engine | None) -> Engine:
    if trainer is None:
        raise ValueError(f"role {spec.name!r}: rollout={spec.rollout!r} samples with the role's own model and "
                         "needs the engine its backend builds (it is not standalone)")
    return trainer


@dataclass(frozen=True)
class OwnModelRollout:
    """Generation with the role's own model: the lean cached loop, or HF ``generate`` (``hf_generate``)."""

    hf_generate: bool = False
    standalone: bool = False

    def build(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, *,
              trainer: Engine | None) -> Engine:
        refuse_rollout_options(spec)
        engine = require_trainer(spec, trainer)
        if self.hf_generate:
            if not isinstance(engine, ForwardOps):
                raise ValueError(f"role {spec.name!r}: rollout={spec.rollout!r} runs HF generate on a training "
                                 f"backend's model (torch, fsdp, deepspeed); backend {spec.backend!r} built a "
                                 f"{type(engine).__name__}")
            engine.use_hf_generate = True
        return engine


ROLLOUTS.add("native", OwnModelRollout())
ROLLOUTS.add("hf_generate", OwnModelRollout(hf_generate=True))
