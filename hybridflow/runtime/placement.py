"""Plans the runtime can build without the planner: the trivial colocated plan of a graph."""

from __future__ import annotations

from hybridflow.graph import Graph
from hybridflow.planner import Plan, colocated_plan


def default_plan(graph: Graph, *, num_gpus: int = 1, device: str = "cpu", dtype: str = "fp32") -> Plan:
    """Every GPU role of ``graph`` on one group of ``num_gpus``; reward functions on the driver."""
    gpu_roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    driver_roles = [role.name for role in graph.roles if not role.kind.needs_gpu]
    return colocated_plan(graph.name, gpu_roles, driver_roles, num_gpus=num_gpus, device=device, dtype=dtype)
