"""Placement planner: assigns roles to GPU groups with a parallel layout. Torch-free.

``plan_placement`` searches; ``evaluate_mapping`` costs a hand-written mapping with the same model;
``compare_plans`` explains the difference. Plans are immutable, JSON-serialisable values.
"""

from hybridflow.planner.agents import AgentWorkload, predict_agent_schedules
from hybridflow.planner.calibration import Calibration, Constants
from hybridflow.planner.cluster import Cluster, Machine
from hybridflow.planner.compare import compare_plans
from hybridflow.planner.devices import DEVICES, DeviceSpec, get_device
from hybridflow.planner.errors import InfeasibleError
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.lora_costs import LoraPlan
from hybridflow.planner.manual import evaluate_mapping, parse_mapping
from hybridflow.planner.models import PRESETS, ModelSpec
from hybridflow.planner.plan import (
    GroupPlan,
    NodeEstimate,
    Plan,
    RoleLayout,
    SearchStats,
    Sharding,
    colocated_plan,
    detachable_policies,
    rollout_role,
)
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.search import PlannerOptions, plan_placement
from hybridflow.planner.settings import Offload, RunSettings
from hybridflow.planner.support import ANY_LAYOUT, LayoutSupport
from hybridflow.planner.vision import VisionSpec

__all__ = [
    "ANY_LAYOUT",
    "DEVICES",
    "PRESETS",
    "AgentWorkload",
    "Calibration",
    "Cluster",
    "Constants",
    "DeviceSpec",
    "ExecutionMode",
    "GroupPlan",
    "InfeasibleError",
    "LayoutSupport",
    "LengthDistribution",
    "LoraPlan",
    "Machine",
    "ModelSpec",
    "NodeEstimate",
    "Offload",
    "Plan",
    "PlanRequest",
    "PlannerOptions",
    "RoleLayout",
    "RunSettings",
    "SearchStats",
    "Sharding",
    "VisionSpec",
    "colocated_plan",
    "compare_plans",
    "detachable_policies",
    "evaluate_mapping",
    "get_device",
    "parse_mapping",
    "plan_placement",
    "predict_agent_schedules",
    "rollout_role",
]
