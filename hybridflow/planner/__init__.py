"""Placement planner: assigns roles to GPU groups with a parallel layout. Torch-free.

``plan_placement`` searches; ``evaluate_mapping`` costs a hand-written mapping with the same model;
``compare_plans`` explains the difference. Plans are immutable, JSON-serialisable values.
"""

from hybridflow.planner.cluster import Cluster, Machine
from hybridflow.planner.devices import DEVICES, DeviceSpec, get_device
from hybridflow.planner.errors import InfeasibleError
from hybridflow.planner.models import PRESETS, ModelSpec
from hybridflow.planner.plan import GroupPlan, NodeEstimate, Plan, RoleLayout, SearchStats, Sharding, colocated_plan
from hybridflow.planner.search import PlannerOptions, plan_placement

__all__ = [
    "DEVICES",
    "PRESETS",
    "Cluster",
    "DeviceSpec",
    "GroupPlan",
    "InfeasibleError",
    "Machine",
    "ModelSpec",
    "NodeEstimate",
    "Plan",
    "PlannerOptions",
    "RoleLayout",
    "SearchStats",
    "Sharding",
    "colocated_plan",
    "get_device",
    "plan_placement",
]
