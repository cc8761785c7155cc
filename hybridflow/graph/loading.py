"""Turn an algorithm name or ``path/to/file.py:function`` into a graph."""

from __future__ import annotations

from typing import Any

from hybridflow.graph.graph import Graph
from hybridflow.registry import ALGORITHMS


def load_graph(spec: str, **options: Any) -> Graph:
    """A built-in algorithm by name (``"ppo"``), or a user's ``file.py:function`` / ``module:function``.

    The target may be a :class:`Graph` or a function returning one; ``options`` go to the function.
    """
    target = ALGORITHMS.get(spec)
    graph = target(**options) if callable(target) else target
    if not isinstance(graph, Graph):
        raise TypeError(f"{spec!r} gave a {type(graph).__name__}, not a Graph; return GraphBuilder(...).build()")
    return graph
