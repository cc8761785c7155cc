"""Explain, in words, why one plan's modelled step time differs from another's."""

from __future__ import annotations

from hybridflow.planner.errors import gib
from hybridflow.planner.modes import describe_mode
from hybridflow.planner.plan import Plan, RoleLayout


def describe_layout(layout: RoleLayout) -> str:
    text = f"dp={layout.dp} tp={layout.tp} {layout.sharding.value} mbs={layout.micro_batch_size} {layout.dtype}"
    if layout.gradient_checkpointing:
        text += " ckpt"
    return text


def describe_groups(plan: Plan) -> list[str]:
    return [f"[{', '.join(g.roles)}] on {g.size}x{g.device} (GPUs {_span(g.gpus)}), "
            f"{gib(g.memory_per_gpu_bytes)}/{gib(g.capacity_bytes)} per GPU" for g in plan.groups]


def _span(gpus: tuple[int, ...]) -> str:
    return f"{gpus[0]}-{gpus[-1]}" if gpus == tuple(range(gpus[0], gpus[-1] + 1)) else ",".join(map(str, gpus))


def _idle(plan: Plan) -> float:
    value = dict(plan.extra).get("idle_fraction", 0.0)
    return float(value)


def compare_plans(auto: Plan, manual: Plan, *, names: tuple[str, str] = ("auto", "manual")) -> str:
    """A few lines: the two step times, their ratio, and the differences that explain it."""
    a, m = names
    lines = []
    if not manual.feasible:
        lines.append(f"{m} plan does not fit: " + "; ".join(manual.problems))
    ratio = manual.step_time_s / auto.step_time_s if auto.step_time_s else float("inf")
    verdict = (f"{a} is {ratio:.2f}x faster" if ratio > 1.0005 else
               f"{m} is {1 / ratio:.2f}x faster" if ratio < 0.9995 else "they tie")
    lines.append(f"step time: {a} {auto.step_time_s:.3g} s, {m} {manual.step_time_s:.3g} s ({verdict})")
    for name, plan in ((a, auto), (m, manual)):
        lines.append(f"{name}: " + "; ".join(describe_groups(plan)) + f" - GPUs used {plan.num_gpus}")
    if (auto.pipeline, bool(auto.detached_rollouts)) != (manual.pipeline, bool(manual.detached_rollouts)):
        lines.append(f"execution modes: {a} {describe_mode(auto)}; {m} {describe_mode(manual)}")
    for name, plan in ((a, auto), (m, manual)):
        lines.append(f"{name} bottleneck: {plan.bottleneck}; idle GPU time {_idle(plan):.0%}")
    lines.extend(_node_differences(auto, manual, names))
    if auto.cross_group_bytes != manual.cross_group_bytes:
        lines.append(f"cross-group data per step: {a} {auto.cross_group_bytes / 1e6:.1f} MB, "
                     f"{m} {manual.cross_group_bytes / 1e6:.1f} MB")
    if auto.weight_sync_bytes != manual.weight_sync_bytes:
        lines.append(f"rollout weight refresh per step: {a} {gib(auto.weight_sync_bytes)}, "
                     f"{m} {gib(manual.weight_sync_bytes)}")
    return "\n".join(lines)


def _node_differences(auto: Plan, manual: Plan, names: tuple[str, str], limit: int = 3) -> list[str]:
    """The nodes whose time changed most, with the layouts behind the change."""
    theirs = {n.node: n for n in manual.nodes}
    changes = []
    for node in auto.nodes:
        other = theirs.get(node.node)
        if other is None or node.group is None or other.group is None:
            continue
        changes.append((abs(other.seconds - node.seconds), node, other))
    changes.sort(key=lambda c: -c[0])
    lines = []
    for delta, node, other in changes[:limit]:
        if delta <= 1e-3 * max(auto.step_time_s, 1e-9):
            break
        lines.append(f"{node.node}: {names[0]} {node.seconds:.3g} s ({_where(auto, node.group, node.role)}) vs "
                     f"{names[1]} {other.seconds:.3g} s ({_where(manual, other.group, other.role)})")
    return lines


def _where(plan: Plan, group: int | None, role: str | None) -> str:
    if group is None or role is None:
        return "driver"
    placed = plan.groups[group]
    return f"{placed.size}x{placed.device}, {describe_layout(placed.layout(role))}"
