"""The DeepSpeed backend: ZeRO stages 0-3, fp32/bf16/fp16, optional optimizer offload.

Registered under the ``hybridflow.backends`` entry-point group as ``deepspeed``;
its engines generate with the ``native`` and ``hf_generate`` rollouts (``hybridflow.rollouts``). ``deepspeed`` itself is
imported when an engine is built, with an error naming the extra to install when it is missing.
"""

import hybridflow.backends.common.rollout  # noqa: F401 (registers the native and hf_generate rollouts)
from hybridflow.backends.deepspeed.config import DeepSpeedOptions, build_config
from hybridflow.backends.deepspeed.engine import BACKEND, DeepSpeedBackend, DeepSpeedRoleEngine

from hybridflow.registry import BACKENDS

BACKENDS.add("deepspeed", BACKEND)

__all__ = ["BACKEND", "DeepSpeedBackend", "DeepSpeedOptions", "DeepSpeedRoleEngine", "build_config"]
