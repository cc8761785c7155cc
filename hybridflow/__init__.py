"""hybridflow: RL post-training of LLMs as a dataflow graph of role nodes.

Importing the package is cheap: the graph DSL and planner are pure Python; torch and ray load only
when a run starts.
"""

from hybridflow._version import __version__

__all__ = ["__version__"]
