"""Human-readable plan tables (rich). Imported only by the CLI, so the planner itself stays light."""

from __future__ import annotations

from hybridflow.planner.compare import describe_layout
from hybridflow.planner.errors import gib
from hybridflow.planner.fleet import describe_fleet, fleets
from hybridflow.planner.modes import describe_mode
from hybridflow.planner.plan import Plan


def render_plan(plan: Plan, title: str) -> None:
    """Print the groups, the node timeline and the totals of ``plan``."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    groups = Table(title=f"{title}: {plan.algorithm}, step {plan.step_time_s:.3g} s"
                         f"{'' if plan.feasible else ' (INFEASIBLE)'}")
    for column in ("group", "GPUs", "device", "roles and layouts", "memory/GPU"):
        groups.add_column(column)
    for index, group in enumerate(plan.groups):
        layouts = "\n".join(f"{lay.role}: {describe_layout(lay)}" for lay in group.layouts)
        memory = f"{gib(group.memory_per_gpu_bytes)} / {gib(group.capacity_bytes)}"
        groups.add_row(str(index), _span(group.gpus), group.device, layouts, memory)
    if plan.driver_roles:
        groups.add_row("driver", "-", "CPU", ", ".join(plan.driver_roles), "-")
    console.print(groups)
    nodes = Table(title="schedule (seconds)")
    for column in ("node", "group", "start", "end", "seconds"):
        nodes.add_column(column, justify="right" if column != "node" else "left")
    for node in plan.nodes:
        nodes.add_row(node.node, "driver" if node.group is None else str(node.group), f"{node.start_s:.3g}",
                      f"{node.end_s:.3g}", f"{node.seconds:.3g}")
    console.print(nodes)
    console.print(f"bottleneck: {plan.bottleneck}")
    console.print(f"execution mode: {dict(plan.extra).get('pipeline_choice') or describe_mode(plan)}")
    if dict(plan.extra).get("step_terms"):
        console.print(f"step beyond the graph (amortised): {dict(plan.extra)['step_terms']}")
    if dict(plan.extra).get("agent_schedule"):
        console.print(str(dict(plan.extra)["agent_schedule"]))
    if dict(plan.extra).get("vision"):
        console.print(f"vision tower: {dict(plan.extra)['vision']}")
    if dict(plan.extra).get("lora"):
        console.print(f"LoRA: {dict(plan.extra)['lora']}")
    for role in fleets(plan):
        console.print(f"rollout servers: {describe_fleet(plan, role)}")
    shipped = f" (shipped to {', '.join(plan.detached_rollouts.values())})" if plan.detached_rollouts else ""
    console.print(f"cross-group bytes/step: {plan.cross_group_bytes / 1e6:.1f} MB; rollout weight refresh: "
                  f"{gib(plan.weight_sync_bytes)} in {plan.weight_sync_seconds:.3g} s{shipped}")
    for problem in plan.problems:
        console.print(f"[red]problem:[/red] {problem}")
    if plan.search is not None:
        console.print(f"search: {plan.search.method}, {plan.search.candidates} candidates, {plan.search.seconds} s")


def _span(gpus: tuple[int, ...]) -> str:
    return f"{gpus[0]}-{gpus[-1]}" if gpus == tuple(range(gpus[0], gpus[-1] + 1)) else ",".join(map(str, gpus))
