"""The DeepSpeed backend: ZeRO stages 0-3, fp32/bf16/fp16, optional optimizer offload.

Registered under the ``hybridflow.backends`` entry-point group as ``deepspeed``. ``deepspeed`` itself is
imported when an engine is built, with an error naming the extra to install when it is missing.
"""

from hybridflow.backends.deepspeed.config import DeepSpeedOptions, build_config
from hybridflow.backends.deepspeed.engine import BACKEND, DeepSpeedBackend, DeepSpeedRoleEngine

from hybridflow.registry import BACKENDS

BACKENDS.add("deepspeed", BACKEND)

__all__ = ["BACKEND", "DeepSpeedBackend", "DeepSpeedOptions", "DeepSpeedRoleEngine", "build_config"]
