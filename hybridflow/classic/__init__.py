"""The classic, verl-tutorial style API: explicit device meshes per role and a single controller."""

from hybridflow.classic.config import ConfigError, DataParallelConfig
from hybridflow.classic.controller import PlanCheck, SingleController

__all__ = ["ConfigError", "DataParallelConfig", "PlanCheck", "SingleController"]
