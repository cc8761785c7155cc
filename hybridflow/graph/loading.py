"""Turn an algorithm name or ``path/to/file.py:function`` into a graph."""

from __future__ import annotations

import inspect
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


def takes_option(spec: str, option: str) -> bool:
    """Whether the algorithm ``spec`` names takes keyword ``option`` (a factory taking ``**options`` takes any, a
    ready :class:`Graph` none): ``reward_kind`` goes only to graphs with a reward role (an LLM judge's has none)."""
    target = ALGORITHMS.get(spec)
    if not callable(target):
        return False
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin or C callable: let the call say
        return True
    return option in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
