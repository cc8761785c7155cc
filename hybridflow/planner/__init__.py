"""Placement planner: assigns roles to GPU groups with a parallel layout. Torch-free."""

from hybridflow.planner.plan import GroupPlan, NodeEstimate, Plan, RoleLayout, SearchStats, Sharding, colocated_plan

__all__ = ["GroupPlan", "NodeEstimate", "Plan", "RoleLayout", "SearchStats", "Sharding", "colocated_plan"]
