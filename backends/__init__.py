"""Execution backends for role workers (torch reference, FSDP, DeepSpeed, vLLM).

Each backend is a sub-package implementing the contracts in ``hybridflow.runtime.protocols`` and
registering itself; third-party backends register through the ``hybridflow.backends`` entry points.
"""
