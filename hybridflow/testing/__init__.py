"""Helpers for users who property-test their own plans.

``check_plan`` asserts a plan's invariants; ``hybridflow.testing.strategies`` (needs hypothesis) draws
clusters, models, workloads and graphs; ``brute_force_step_time`` is the exhaustive reference search.
"""

from hybridflow.testing.brute import brute_force_step_time
from hybridflow.testing.checks import PlanCheckError, check_plan

__all__ = ["PlanCheckError", "brute_force_step_time", "check_plan"]
