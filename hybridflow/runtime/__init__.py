"""The single-controller runtime: batches, worker groups, local and Ray executors.

Imports torch; ``hybridflow.graph`` and ``hybridflow.planner`` stay free of it.
"""

from hybridflow.runtime.batch import Batch
from hybridflow.runtime.controller import Controller, StepResult
from hybridflow.runtime.errors import NonFiniteLossError, RewardFunctionError, RuntimeStepError, WorkerFailedError
from hybridflow.runtime.executor import Executor, LocalExecutor, WorkerGroup
from hybridflow.runtime.placement import default_plan
from hybridflow.runtime.protocols import (
    Backend,
    Collective,
    OptimSpec,
    RoleEngine,
    RoleSpec,
    SamplingParams,
    Scorer,
    WorkerContext,
)

__all__ = ["Backend", "Batch", "Collective", "Controller", "Executor", "LocalExecutor", "NonFiniteLossError",
           "OptimSpec", "RewardFunctionError", "RoleEngine", "RoleSpec", "RuntimeStepError", "SamplingParams",
           "Scorer", "StepResult", "WorkerContext", "WorkerFailedError", "WorkerGroup", "default_plan"]
