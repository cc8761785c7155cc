"""A planning problem: the graph's roles with their models and per-step work, on a cluster."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from hybridflow.graph import Graph, NodeLoad, Op, RoleKind, Workload, edge_bytes, node_loads
from hybridflow.planner.agents import AgentNode, AgentWorkload, agent_nodes, engine_prefix_caching
from hybridflow.planner.calibration import DEFAULT_CALIBRATION, Calibration
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.costs import FORWARD_OPS
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.lora_costs import LoraPlan
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.modes import check_pipeline
from hybridflow.planner.overlays import ControllerOverlay
from hybridflow.planner.plan import ROLLOUT_SUFFIX, rollout_role
from hybridflow.planner.settings import DEFAULT_SETTINGS, RunSettings
from hybridflow.planner.support import ANY_LAYOUT, LayoutSupport


@dataclass(frozen=True, kw_only=True)
class RoleWork:
    """One GPU role: its model and the loads of its nodes, by kind of pass."""

    name: str
    kind: RoleKind
    model: ModelSpec
    forward: tuple[NodeLoad, ...]
    update: tuple[NodeLoad, ...]
    generate: tuple[NodeLoad, ...]
    rows: int
    ships_to: str | None = None  # the detached rollout role this policy sends its weights to after updating
    streams: bool = False  # async: a detached rollout generating continuously across steps (``modes.py``)
    agents: tuple[AgentNode, ...] = ()  # its multi-turn generate nodes (``agents.py``)
    guests: tuple[str, ...] = ()  # frozen roles whose forward nodes run on this role's weights (``shared_weights``)
    token_budget: int | None = None  # tokens per micro batch and GPU the user fixed (None: the run's, else rows)
    served: bool = False  # a detached rollout generating through server replicas behind a router (``fleet.py``)

    def agent(self, node: str) -> AgentNode | None:
        """The multi-turn spec of generate node ``node``; None for a single-turn one."""
        return next((agent for agent in self.agents if agent.node == node), None)

    @property
    def generates_only(self) -> bool:
        """A detached rollout: generate nodes and nothing else."""
        return bool(self.generate) and not self.forward and not self.update

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(load.node for load in (*self.generate, *self.forward, *self.update))


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Everything the search needs, derived once from the user's inputs."""

    graph: Graph
    workload: Workload
    cluster: Cluster
    roles: tuple[RoleWork, ...]
    driver_roles: tuple[str, ...]
    edge_bytes: Mapping[tuple[str, str], int]
    node_role: Mapping[str, str | None]  # node -> its GPU role, None for driver-side nodes
    apart: tuple[tuple[str, str], ...] = ()  # (policy, its rollout): roles that must not share a group
    max_tp: int | None = None  # cap on training/forward tensor parallelism (None: up to 8)
    support: Mapping[str, LayoutSupport] = field(default_factory=dict)  # role -> what its backend runs
    micro_batch_sizes: Mapping[str, int] = field(default_factory=dict)  # role -> the user's fixed micro batch
    settings: RunSettings = DEFAULT_SETTINGS
    calibration: Calibration = DEFAULT_CALIBRATION
    mode: ExecutionMode = field(default_factory=ExecutionMode)  # overlapped modes: detached generate nodes
    agents: tuple[AgentNode, ...] = ()  # multi-turn generate nodes and the inputs they are costed with
    shared_weights: Mapping[str, str] = field(default_factory=dict)  # guest role -> the role whose weights it uses
    overlay: ControllerOverlay | None = None  # another framework's costs, when pricing its runs (overlays.py)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.roles)

    def support_of(self, role: str) -> LayoutSupport:
        """What ``role``'s backend runs; a detached rollout without its own entry runs its policy's."""
        return _support_of(self.support, role)

    def role(self, name: str) -> RoleWork:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"{name!r} is not a GPU role of {self.graph.name}; GPU roles: {list(self.role_names)}")


def build_problem(graph: Graph, models: Mapping[str, ModelSpec], workload: Workload, cluster: Cluster, *,
                  detach: Collection[str] = (), max_tp: int | None = None, settings: RunSettings | None = None,
                  calibration: Calibration | None = None, pipeline: str = "sync",
                  max_staleness: int | None = None, stream_chunks: int = 1,
                  support: Mapping[str, LayoutSupport] | None = None,
                  micro_batch_sizes: Mapping[str, int] | None = None, token_budgets: Mapping[str, int] | None = None,
                  agent: AgentWorkload | None = None, adapters: Mapping[str, LoraPlan] | None = None,
                  shared_weights: Mapping[str, str] | None = None, overlay: ControllerOverlay | None = None) -> Problem:
    """Check the inputs against each other and precompute per-role loads and edge sizes.

    ``detach`` names trainable policies whose rollout runs on GPUs of its own: their generate nodes move
    to a frozen role ``<policy>:rollout`` (same model) that receives the weights after every update.
    ``pipeline="one_step_off"`` costs those generate nodes as overlapping the rest of the step, and
    ``"async"`` as a pool generating continuously at most ``max_staleness`` updates ahead (default 1)
    (``hybridflow.planner.modes``); both need a detached rollout. ``stream_chunks`` > 1: a sync step
    streamed in that many chunks (``assemble.build_plan(streamed=...)`` costs it). ``support``: per role, the
    layouts its backend runs (:mod:`.support`); ``micro_batch_sizes``: per role, a micro batch the user fixed;
    ``token_budgets``: per role, the tokens per micro batch and GPU the user fixed (its layouts carry it and are
    costed with it).
    ``agent``: what the graph's multi-turn generate nodes (``environment`` set) do (:mod:`.agents`); None costs
    them at half their ``max_turns`` without tool latency, and refuses inputs for a graph without such nodes.
    ``adapters``: per trainable role, the LoRA adapter it trains (:mod:`.lora_costs`; its ``sync`` None becomes the
    dry run's engine: adapter-only on GPUs, where vLLM runs, merged on CPU). ``shared_weights``: frozen roles that
    run on a LoRA role's engine with its adapter disabled (``{"reference": "actor"}``): their nodes move to that
    role, which holds no second copy of the base. ``overlay``: another framework's costs laid over the model, to
    price that framework's runs (:mod:`.overlays`; never for a plan hybridflow runs).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a hybridflow Graph, got {type(graph).__name__}; use load_graph('ppo')")
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if settings is not None and not isinstance(settings, RunSettings):
        raise TypeError(f"settings must be a RunSettings, got {type(settings).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be a Calibration (Calibration.load(path)), got {type(calibration).__name__}")
    known = set(graph.role_names)
    for name, model in models.items():
        if name not in known:
            raise ValueError(f"models names role {name!r}, which graph {graph.name!r} lacks; roles: {sorted(known)}")
        if not isinstance(model, ModelSpec):
            raise TypeError(f"models[{name!r}] must be a ModelSpec, got {type(model).__name__}")
    if agent is not None and not isinstance(agent, AgentWorkload):
        raise TypeError(f"agent must be an AgentWorkload, got {type(agent).__name__}")
    agents = agent_nodes(graph, agent, prefix_caching=engine_prefix_caching(cluster))
    loads = node_loads(graph, workload)
    roles, drivers = [], []
    for role in graph.roles:
        if not role.kind.needs_gpu:
            drivers.append(role.name)
            continue
        if role.name not in models:
            raise ValueError(f"no model for role {role.name!r}; pass models[{role.name!r}] = "
                             f"ModelSpec.preset('llama3-8b') (or --model {role.name}=...)")
        # A role reads a sample's images when its model has a vision tower; a text-only model reads the text.
        reads_images = models[role.name].vision is not None
        mine = [loads[node.name] if reads_images else loads[node.name].text_only()
                for node in graph.nodes_of(role.name)]
        roles.append(RoleWork(
            name=role.name, kind=role.kind, model=models[role.name],
            forward=tuple(load for load in mine if load.op in FORWARD_OPS),
            update=tuple(load for load in mine if load.op is Op.UPDATE),
            generate=tuple(load for load in mine if load.op is Op.GENERATE),
            rows=workload.sequences(graph), token_budget=(token_budgets or {}).get(role.name),
            agents=tuple(a for a in agents if any(a.node == load.node for load in mine))))
    if not roles:
        raise ValueError(f"graph {graph.name!r} has no role that needs a GPU; nothing to place")
    gpu_roles = {role.name for role in roles}
    node_role = {node.name: node.role if node.role in gpu_roles else None for node in graph.nodes}
    roles = _with_adapters(roles, dict(adapters or {}), engine_prefix_caching(cluster))
    shared = dict(shared_weights or {})
    roles = _share_weights(roles, shared, node_role)
    roles, apart = _detach_rollouts(roles, detach, node_role, streams=pipeline == "async")
    served = {name for name in gpu_roles if _support_of(support or {}, rollout_role(name)).served}
    roles = [replace(work, served=True) if work.generates_only and work.name.removesuffix(ROLLOUT_SUFFIX) in served
             else work for work in roles]
    colocated = sorted(served - set(detach))
    if colocated:
        policy = colocated[0]
        raise ValueError(f"role {policy!r} generates through server replicas behind a router (its rollout's backend "
                         "is served, rollout: server): the fleet runs on GPUs of its own, never the trainer's. Give it "
                         f"GPUs ('{policy}{ROLLOUT_SUFFIX}=<GPUs not shared with {policy}>' in the mapping, or let the "
                         "search split the pool), or use rollout: vllm to generate on the trainer's GPUs")
    mode = ExecutionMode.checked(key=str, pipeline=pipeline, max_staleness=max_staleness, stream_chunks=stream_chunks)
    check_pipeline(mode, graph, detached=bool(apart))
    placed = {role.name for role in roles} | {rollout_role(name) for name in gpu_roles} | set(shared)
    for what, given in (("support", support or {}), ("micro_batch_sizes", micro_batch_sizes or {}),
                        ("token_budgets", token_budgets or {})):
        unknown = sorted(set(given) - placed)
        if unknown:
            raise ValueError(f"{what} names {unknown}, which are not GPU roles of this problem; "
                             f"roles: {sorted(placed)}")
    for name, size in (micro_batch_sizes or {}).items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"micro_batch_sizes[{name!r}]={size!r} must be a positive integer (rows per pass "
                             "per rank)")
    return Problem(support=dict(support or {}), micro_batch_sizes=dict(micro_batch_sizes or {}),
                   graph=graph, workload=workload, cluster=cluster, roles=tuple(roles), driver_roles=tuple(drivers),
                   edge_bytes=edge_bytes(graph, workload), node_role=node_role, apart=apart, max_tp=max_tp,
                   settings=settings or DEFAULT_SETTINGS, calibration=calibration or DEFAULT_CALIBRATION,
                   mode=mode, agents=agents, shared_weights=shared, overlay=overlay)


def _support_of(support: Mapping[str, LayoutSupport], role: str) -> LayoutSupport:
    return support.get(role) or support.get(role.removesuffix(ROLLOUT_SUFFIX)) or ANY_LAYOUT


def role_adapters(graph: Graph, lora: LoraPlan | Mapping[str, LoraPlan] | None) -> dict[str, LoraPlan]:
    """Per role, its adapter: one :class:`LoraPlan` goes to every trainable policy of ``graph``; a mapping names
    the roles (a critic may train one too)."""
    if lora is None:
        return {}
    if isinstance(lora, LoraPlan):
        return {role.name: lora for role in graph.roles if role.kind is RoleKind.POLICY}
    return dict(lora)


def shareable_references(graph: Graph, models: Mapping[str, ModelSpec],
                         adapters: Mapping[str, LoraPlan]) -> dict[str, str]:
    """Frozen roles that may run on a LoRA policy's engine with its adapter disabled: those with only forward
    nodes (a reference's ``ref_logprob``) whose model is the policy's base. ``{guest: policy}``."""
    hosts = [name for name in adapters if graph.role(name).kind is RoleKind.POLICY]
    found = {}
    for role in graph.roles:
        nodes = graph.nodes_of(role.name)
        if role.kind is not RoleKind.FROZEN_POLICY or not nodes or any(n.op not in FORWARD_OPS for n in nodes):
            continue
        host = next((name for name in hosts if models.get(name) == models.get(role.name)), None)
        if host is not None:
            found[role.name] = host
    return found


def _with_adapters(roles: list[RoleWork], adapters: dict[str, LoraPlan], vllm: bool) -> list[RoleWork]:
    """Each named trainable role's model with its adapter; a ``sync`` left None is the dry run's engine's."""
    by_name = {role.name: role for role in roles}
    for name, plan in adapters.items():
        if not isinstance(plan, LoraPlan):
            raise TypeError(f"adapters[{name!r}] must be a LoraPlan, got {type(plan).__name__}")
        work = by_name.get(name)
        if work is None or not work.kind.trainable:
            trainable = sorted(role.name for role in roles if role.kind.trainable)
            raise ValueError(f"lora names role {name!r}: only a trainable GPU role trains an adapter (here: "
                             f"{trainable})")
    resolved = {name: plan if plan.sync else replace(plan, sync="adapter" if vllm else "merged")
                for name, plan in adapters.items()}
    return [replace(role, model=role.model.with_adapter(resolved[role.name])) if role.name in resolved else role
            for role in roles]


def _share_weights(roles: list[RoleWork], shared: dict[str, str], node_role: dict[str, str | None]) -> list[RoleWork]:
    """Move each guest's forward nodes onto its host (a LoRA role whose frozen base is the guest's model)."""
    by_name = {role.name: role for role in roles}
    for guest, host in shared.items():
        work, owner = by_name.get(guest), by_name.get(host)
        if work is None or work.kind is not RoleKind.FROZEN_POLICY or work.generate or work.update:
            raise ValueError(f"shared_weights[{guest!r}]: only a frozen policy with forward nodes alone (a "
                             "reference's ref_logprob) can run on another role's weights")
        if owner is None or owner.model.adapter is None:
            raise ValueError(f"shared_weights[{guest!r}]={host!r}: the host must be a GPU role that trains a LoRA "
                             f"adapter (its base stays frozen, so it is {guest!r}'s model); give {host!r} an "
                             "adapter (PlanRequest(..., lora=...)) or drop the entry")
        if owner.model.base != work.model:
            raise ValueError(f"shared_weights[{guest!r}]={host!r}: {guest!r}'s model {work.model.name} is not "
                             f"{host!r}'s base {owner.model.name}; only the policy's own base is shared")
        by_name[host] = replace(by_name[host], forward=by_name[host].forward + work.forward,
                                guests=(*by_name[host].guests, guest))
        node_role.update({load.node: host for load in work.forward})
    return [by_name[role.name] for role in roles if role.name not in shared]


def _detach_rollouts(roles: list[RoleWork], detach: Collection[str], node_role: dict[str, str | None], *,
                     streams: bool = False) -> tuple[list[RoleWork], tuple[tuple[str, str], ...]]:
    """Split each named policy into its trainer and a generate-only rollout role; moves nodes in ``node_role``."""
    by_name = {role.name: role for role in roles}
    for name in detach:
        work = by_name.get(name)
        if work is None or not (work.generate and work.update):
            generating = sorted(r.name for r in roles if r.generate and r.update)
            raise ValueError(f"cannot give role {name!r} a separate rollout: only a trainable policy that "
                             f"generates can have one (here: {generating})")
    split: list[RoleWork] = []
    apart = []
    for work in roles:
        if work.name not in detach:
            split.append(work)
            continue
        rollout = rollout_role(work.name)
        split.append(replace(work, generate=(), ships_to=rollout))
        split.append(RoleWork(name=rollout, kind=RoleKind.FROZEN_POLICY, model=work.model, forward=(), update=(),
                              generate=work.generate, rows=work.rows, streams=streams, agents=work.agents))
        node_role.update({load.node: rollout for load in work.generate})
        apart.append((work.name, rollout))
    return split, tuple(apart)
