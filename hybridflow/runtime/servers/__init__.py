"""Inference servers hybridflow starts and owns: replica processes, the router in front, and a token-exact client.

``process.py``: one server process (port, log, process group, health deadline); ``guard.py``: the watcher that
ends them when the driver dies; ``fleet.py``: N replicas behind ``vllm-router``; ``client.py``: token ids in,
token ids and log-probs out over ``/v1/completions``. The vLLM server command and the ``server`` rollout engine
are the vLLM backend's (``backends/vllm/server.py``).
"""

from hybridflow.runtime.servers.client import (
    Completion,
    CompletionRequest,
    CompletionsClient,
    ServerRequestError,
)
from hybridflow.runtime.servers.fleet import FleetConfig, FleetDownError, RouterDownError, ServerFleet
from hybridflow.runtime.servers.process import AttachedServer, PortInUseError, ServerProcess, ServerStartError

__all__ = ["AttachedServer", "Completion", "CompletionRequest", "CompletionsClient", "FleetConfig", "FleetDownError",
           "PortInUseError", "RouterDownError",
           "ServerFleet", "ServerProcess", "ServerRequestError", "ServerStartError"]
