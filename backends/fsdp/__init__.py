"""The FSDP2 backend: roles sharded over their group's data-parallel ranks with ``fully_shard``.

Registered under the ``hybridflow.backends`` entry-point group as ``fsdp``;
its engines generate with the ``native`` and ``hf_generate`` rollouts (``hybridflow.rollouts``). Runs on gloo (CPU) and
NCCL (CUDA); one process per rank (the Ray executor or ``torchrun``).
"""

import hybridflow.backends.common.rollout  # noqa: F401 (registers the native and hf_generate rollouts)
from hybridflow.backends.fsdp.engine import BACKEND, FsdpBackend, FsdpOptions, FsdpRoleEngine

from hybridflow.registry import BACKENDS

BACKENDS.add("fsdp", BACKEND)

__all__ = ["BACKEND", "FsdpBackend", "FsdpOptions", "FsdpRoleEngine"]
