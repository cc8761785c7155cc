"""Planner errors, and the explanation of why nothing fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.planner.devices import GIB
from hybridflow.planner.layouts import Constraint, role_candidates, usable_bytes

if TYPE_CHECKING:
    from hybridflow.planner.groups import GroupEvaluator
    from hybridflow.planner.problem import Problem


class InfeasibleError(ValueError):
    """No placement of the roles fits the cluster's memory; the message says what and by how much."""


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def explain_infeasible(problem: Problem, evaluator: GroupEvaluator) -> str:
    """Name each role that fits nowhere even alone on every GPU of a type, with its shortfall."""
    cluster = problem.cluster
    lines = []
    for role in problem.roles:
        best: tuple[int, int, str] | None = None  # (overflow, need, where)
        for device in cluster.device_names:
            counts = [m.gpus for m in cluster.machines if m.device.name == device]
            shape = evaluator.shape(device, counts)
            candidates = role_candidates(role, shape, shape.device.preferred_dtype, problem.workload.prompt_len,
                                         Constraint(), max_tp=problem.max_tp, support=problem.support_of(role.name))
            need = min((c.static + c.transient for c in candidates), default=None)
            if need is None:
                continue
            over = need - usable_bytes(shape)
            if best is None or over < best[0]:
                best = (over, need, f"all {shape.size}x{device} (usable {gib(usable_bytes(shape))} per GPU)")
        if best is not None and best[0] > 0:
            support = problem.support_of(role.name)
            runs = "" if support.backend == "any" else (
                f" with the layouts backend {support.backend!r} runs (shardings "
                f"{sorted(s.value for s in support.shardings)}, tp <= {support.max_tp or 'any'})")
            lines.append(f"role {role.name!r} ({role.model.name}) needs at least {gib(best[1])} per GPU even alone "
                         f"on {best[2]}{runs}: over by {gib(best[0])}")
    if not lines:
        lines.append(f"each role fits alone, but no split of {cluster.describe()} holds all of "
                     f"{list(problem.role_names)} at once; add GPUs, use smaller models or a smaller batch")
    else:
        lines.append("add GPUs or larger devices, or use a smaller model, batch or sequence length")
    return "no placement fits: " + "; ".join(lines)
