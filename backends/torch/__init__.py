"""The torch reference backend: plain PyTorch + Hugging Face models, data parallel over gloo/threads.

Registered under the ``hybridflow.backends`` entry-point group as ``torch``;
its engines generate with the ``native`` and ``hf_generate`` rollouts (``hybridflow.rollouts``).
"""

import hybridflow.backends.common.rollout  # noqa: F401 (registers the native and hf_generate rollouts)
from hybridflow.backends.torch.engine import BACKEND, TorchBackend, TorchOptions, TorchRoleEngine

from hybridflow.registry import BACKENDS

BACKENDS.add("torch", BACKEND)

__all__ = ["BACKEND", "TorchBackend", "TorchOptions", "TorchRoleEngine"]
