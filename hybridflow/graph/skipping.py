"""Passes whose results are known in advance, taken out of a graph before it is planned or run.

Two rules, each recorded in :attr:`Graph.skipped <hybridflow.graph.Graph.skipped>` (so ``hybridflow graph``
shows them and the planner, which costs the nodes it is given, costs neither):

1. **An unread forward pass is not run** (:func:`prune_unread`): a log-prob, reference log-prob or value node
   whose outputs no node reads is dropped, and a role left without nodes is dropped with it, so it is neither
   placed nor loaded. The built-in algorithms build with it: GRPO with ``kl_coef: 0`` has no KL term, nothing
   reads ``ref_logprobs``, and the reference goes (TRL's ``beta == 0``).
2. **The old log-probs of a single on-policy pass are the update's own, detached**
   (:func:`with_detached_logprobs`): when a role's update is one optimizer step on weights that have not moved
   since the rollout (one epoch, one mini batch, a synchronous step), the log-prob pass before it computes
   exactly what the update's own forward computes, so the importance ratio is identically 1. A log-prob node
   of that role read by that role's updates alone is dropped; each of those updates gets the option
   ``detached_logprobs=<field>`` and fills the field from its own forward, detached (TRL's ``GRPOTrainer`` with
   ``num_iterations == 1`` sets ``old_per_token_logps = per_token_logps.detach()`` the same way). Which roles
   qualify is the caller's to say: it depends on the run's optimisation and execution mode, not the graph.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hybridflow.graph.node import Node, freeze_options
from hybridflow.graph.roles import Op, Role

if TYPE_CHECKING:
    from hybridflow.graph.graph import Graph

DETACHED_LOGPROBS = "detached_logprobs"
"""The update option naming the field the update computes itself: its own log-probs, detached."""

# Forward-only ops with no effect beyond their outputs (a score node's reward is always read; a generate node
# makes the rows).
_PRUNABLE = frozenset({Op.LOGPROB, Op.REF_LOGPROB, Op.VALUES})


@dataclass(frozen=True, slots=True)
class SkippedPass:
    """A node taken out of the graph and why (``role``: its role, when that role went with it)."""

    node: str
    reason: str
    role: str | None = None

    def describe(self) -> str:
        dropped = f"; role {self.role!r} is not placed or loaded" if self.role else ""
        return f"{self.node}: {self.reason}{dropped}"


def prune_unread(roles: Iterable[Role], nodes: Iterable[Node],
                 *, why: str = "") -> tuple[tuple[Role, ...], tuple[Node, ...], tuple[SkippedPass, ...]]:
    """Rule 1: drop forward passes whose outputs no node reads (repeatedly), then roles left without nodes.

    ``why`` (e.g. ``"kl_coef=0"``) is added to each skipped node's reason. Returns the kept roles and nodes and
    what was skipped, in declaration order."""
    kept, skipped = list(nodes), []
    while True:
        read = {name for node in kept for name in node.inputs}
        unread = [node for node in kept if node.op in _PRUNABLE and not read.intersection(node.outputs)]
        if not unread:
            break
        for node in unread:
            kept.remove(node)
            skipped.append(node)
    used = {node.role for node in kept}
    role_list = tuple(roles)
    gone = {role.name for role in role_list if role.name not in used}
    suffix = f" ({why})" if why else ""
    records = tuple(SkippedPass(node.name, f"nothing reads {', '.join(node.outputs)}{suffix}",
                                node.role if node.role in gone else None) for node in skipped)
    return tuple(role for role in role_list if role.name not in gone), tuple(kept), records


def with_detached_logprobs(graph: Graph, single_pass: Collection[str]) -> Graph:
    """Rule 2: ``graph`` without the log-prob passes of the ``single_pass`` roles that only their own updates
    read; those updates compute the field themselves (option ``detached_logprobs``). Unchanged otherwise."""
    readers: dict[str, list[Node]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node.inputs):
            readers.setdefault(name, []).append(node)
    dropped: dict[str, Node] = {}  # update name -> its new form
    skipped: list[SkippedPass] = []
    removed: set[str] = set()
    for node in graph.nodes:
        if node.op is not Op.LOGPROB or node.role not in single_pass:
            continue
        (field,) = node.outputs
        users = readers.get(field, [])
        if not users or any(user.op is not Op.UPDATE or user.role != node.role or user.name in dropped
                            for user in users):
            continue
        for user in users:
            inputs = tuple(name for name in user.inputs if name != field)
            options = freeze_options({**user.options_dict, DETACHED_LOGPROBS: field}, user.name)
            dropped[user.name] = replace(user, inputs=inputs, options=options)
        removed.add(node.name)
        names = ", ".join(user.name for user in users)
        skipped.append(SkippedPass(node.name, f"a single on-policy pass: {names} computes {field} from its own "
                                              "forward, detached (the importance ratio is 1)"))
    if not removed:
        return graph
    nodes = tuple(dropped.get(node.name, node) for node in graph.nodes if node.name not in removed)
    return replace(graph, nodes=nodes, skipped=(*graph.skipped, *skipped))
