"""The classic, verl-tutorial style API: explicit device meshes per role and a single controller."""

from hybridflow.classic.config import ConfigError, DataParallelConfig

__all__ = ["ConfigError", "DataParallelConfig"]
