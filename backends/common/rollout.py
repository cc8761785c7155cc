"""How a trainable policy generates (``RoleSpec.rollout``), one way for every training backend.

``native`` and ``hf_generate`` sample with the trainer's own model (the lean cached loop, or HF
``generate``); ``vllm`` wraps the trainer in a hybrid engine that generates on a vLLM engine in the
same process. A rollout on GPUs of its own is a separate role (``actor:rollout``) whose backend the
run's specs choose (``vllm`` for ``rollout: vllm``); see docs/backends.md for the table.
"""

from __future__ import annotations

from typing import Any

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout
from hybridflow.runtime.protocols import RoleSpec, WorkerContext


def with_configured_rollout(engine: Any, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> Any:
    """``engine`` itself, or wrapped in a vLLM hybrid engine when ``spec.rollout`` is ``vllm``."""
    if spec.rollout_options and spec.rollout != "vllm":
        raise ValueError(f"role {spec.name!r}: rollout_options {sorted(spec.rollout_options)} configure a vLLM "
                         f"rollout, but rollout={spec.rollout!r}; set rollout: vllm or drop them")
    if spec.rollout != "vllm":
        return engine
    if spec.kind is not RoleKind.POLICY:
        raise ValueError(f"role {spec.name!r} is a {spec.kind.value}: rollout: vllm applies to trainable policies "
                         "(a frozen policy served by vLLM uses backend: vllm)")
    from hybridflow.backends.vllm.hybrid import HybridEngine  # vLLM loads only when a role asks for it

    return HybridEngine(engine, spec, layout, context)
