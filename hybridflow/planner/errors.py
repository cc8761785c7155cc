"""Planner errors, and the explanation of why nothing fits."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hybridflow.planner.costs import Shape, state_bytes
from hybridflow.planner.devices import GIB
from hybridflow.planner.layouts import Candidate, Constraint, role_candidates, usable_bytes
from hybridflow.planner.lora_costs import LoraPlan

if TYPE_CHECKING:
    from hybridflow.planner.groups import GroupEvaluator
    from hybridflow.planner.problem import Problem, RoleWork


class InfeasibleError(ValueError):
    """No placement of the roles fits the cluster's memory; the message says what and by how much."""


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


HINT_RANK = 16  # the adapter rank an infeasibility explanation sizes LoRA with


def explain_infeasible(problem: Problem, evaluator: GroupEvaluator) -> str:
    """Name each role that fits nowhere even alone on every GPU of a type, with its shortfall; a fully trained
    role is told what its gradients and optimizer states take and whether a LoRA adapter would fit."""
    cluster = problem.cluster
    lines = []
    for role in problem.roles:
        best = _least_need(problem, evaluator, role)
        if best is not None and best[0] > 0:
            support = problem.support_of(role.name)
            runs = "" if support.backend == "any" else (
                f" with the layouts backend {support.backend!r} runs (shardings "
                f"{sorted(s.value for s in support.shardings)}, tp <= {support.max_tp or 'any'})")
            lines.append(f"role {role.name!r} ({role.model.name}) needs at least {gib(best[1])} per GPU even alone "
                         f"on {best[2]}{runs}: over by {gib(best[0])}{_lora_hint(problem, evaluator, role, best)}")
    if not lines:
        lines.append(f"each role fits alone, but no split of {cluster.describe()} holds all of "
                     f"{list(problem.role_names)} at once; add GPUs, use smaller models or a smaller batch")
        if any(role.kind.trainable and role.model.adapter is None for role in problem.roles):
            lines.append(f"or train LoRA adapters, whose gradients and optimizer states are a fraction of full "
                         f"fine-tuning's ({_ALLOW})")
    else:
        lines.append("add GPUs or larger devices, or use a smaller model, batch or sequence length")
    return "no placement fits: " + "; ".join(lines)


_ALLOW = f"PlanRequest(..., lora=LoraPlan(rank={HINT_RANK})) or `hybridflow plan --lora rank={HINT_RANK}`"
Need = tuple[int, int, str, Candidate, Shape]  # (overflow, need, where, smallest candidate, its shape)


def _least_need(problem: Problem, evaluator: GroupEvaluator, role: RoleWork) -> Need | None:
    """The role's smallest layout over the cluster's device types: the least overflow alone on all of a type."""
    best: Need | None = None
    for device in problem.cluster.device_names:
        counts = [m.gpus for m in problem.cluster.machines if m.device.name == device]
        shape = evaluator.shape(device, counts)
        candidates = role_candidates(role, shape, shape.device.preferred_dtype, problem.workload.prompt_len,
                                     Constraint(), max_tp=problem.max_tp, support=problem.support_of(role.name))
        smallest = min(candidates, key=lambda c: c.static + c.transient, default=None)
        if smallest is None:
            continue
        need = smallest.static + smallest.transient
        over = need - usable_bytes(shape)
        if best is None or over < best[0]:
            best = (over, need, f"all {shape.size}x{device} (usable {gib(usable_bytes(shape))} per GPU)", smallest,
                    shape)
    return best


def _lora_hint(problem: Problem, evaluator: GroupEvaluator, role: RoleWork, best: Need) -> str:
    """For a fully trained role: its gradients and optimizer states at that layout, and a LoRA adapter's need."""
    if not role.kind.trainable or role.model.adapter is not None:
        return ""
    _, grads, states = state_bytes(role.model, role.kind, best[3].layout, best[4])
    adapted = replace(role, model=role.model.with_adapter(LoraPlan(rank=HINT_RANK, sync="merged")))
    lora = _least_need(problem, evaluator, adapted)
    verdict = "" if lora is None else (f"; a rank-{HINT_RANK} LoRA adapter ({adapted.model.adapter_params / 1e6:.0f}M "
                                       f"trainable weights) needs {gib(lora[1])} per GPU alone, "
                                       + ("which fits" if lora[0] <= 0 else f"still over by {gib(lora[0])}"))
    return (f" (full fine-tuning: gradients {gib(grads)} + optimizer states {gib(states)} per GPU of that{verdict}; "
            f"allow LoRA with {_ALLOW})")
