"""hybridflow: RL post-training of LLMs as a dataflow graph of role nodes.

Importing the package is cheap: the graph DSL and planner are pure Python; torch and ray load only
when a run starts. ``DataParallelConfig`` and ``SingleController`` (the classic, verl-tutorial
style API) and ``GRPOTrainer`` (a TRL-shaped Python entry point, :mod:`hybridflow.train.trainer`) are imported
on first use.
"""

from typing import TYPE_CHECKING, Any

from hybridflow import _source_tree
from hybridflow._version import __version__

_source_tree.install(__path__[0])

if TYPE_CHECKING:
    from hybridflow.classic import DataParallelConfig, SingleController
    from hybridflow.train.trainer import GRPOTrainer

__all__ = ["DataParallelConfig", "GRPOTrainer", "SingleController", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("DataParallelConfig", "SingleController"):
        import hybridflow.classic as classic

        return getattr(classic, name)
    if name == "GRPOTrainer":
        from hybridflow.train.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
