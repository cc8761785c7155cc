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
    Engine,
    Generator,
    LogProbModel,
    OptimSpec,
    RewardModel,
    RoleSpec,
    SamplingParams,
    Scorer,
    Trainer,
    ValueModel,
    WeightSink,
    WeightSource,
    WorkerContext,
)

__all__ = ["Backend", "Batch", "Collective", "Controller", "Engine", "Executor", "Generator", "LocalExecutor",
           "LogProbModel", "NonFiniteLossError", "OptimSpec", "RewardFunctionError", "RewardModel", "RoleSpec",
           "RuntimeStepError", "SamplingParams", "Scorer", "StepResult", "Trainer", "ValueModel", "WeightSink",
           "WeightSource", "WorkerContext", "WorkerFailedError", "WorkerGroup", "default_plan"]
