"""The one input every planner entry shares: what is planned, on what, and what the user fixed.

``plan_placement`` (the search), ``evaluate_mapping`` (a hand-written mapping) and the run's
``placement: auto|manual`` all cost the same problem; they differ only in who chooses the placement. A
:class:`PlanRequest` holds everything else once, so the entries cannot drift apart in what they pass on,
and every fixed input (micro batches, token budgets...) is a field the cost model sees while it costs,
never a value written into a finished plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import KW_ONLY, dataclass, field

from hybridflow.graph import Graph, Workload
from hybridflow.planner.agents import AgentWorkload
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.lora_costs import LoraPlan
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.modes import check_choice
from hybridflow.planner.overlays import ControllerOverlay
from hybridflow.planner.problem import Problem, build_problem, role_adapters
from hybridflow.planner.settings import RunSettings
from hybridflow.planner.support import LayoutSupport


@dataclass(frozen=True)
class PlanRequest:
    """A planning problem: the graph, its models, a step's workload, the cluster, and the fixed inputs.

    ``settings``: the run's step recipe (response lengths, mini-batches, offload...); ``calibration``: the
    cost model's fitted constants (``Calibration.load(path)``, written by ``hybridflow calibrate``);
    ``support``: per role (a detached rollout as ``actor:rollout``), the layouts its backend runs
    (:mod:`.support`; empty: any layout); ``agent``: what the graph's multi-turn generate nodes do
    (:class:`~hybridflow.planner.agents.AgentWorkload`); ``lora``: a LoRA adapter for every trainable policy,
    or one per role; ``shared_weights``: frozen roles that run on a LoRA role's engine with its adapter
    disabled (``{"reference": "actor"}``).

    ``pipeline``: the execution mode costed, "sync", "one_step_off", "async" or "auto" (the fastest the
    placement can run); ``max_staleness``: async's bound k (None with "auto": k = 1 and 2 compared);
    ``stream_chunks``: a sync step streamed in that many chunks (only a hand-written mapping's step is
    costed streamed; the search plans unstreamed steps).

    ``micro_batch_sizes``: per role, rows per pass and rank the user fixed; ``token_budgets``: per role, the
    tokens per micro batch and GPU the user fixed (update and forward passes): the plan's layouts carry them
    and the plan is costed with them. ``overlay``: another framework's costs, to price its runs
    (:mod:`.overlays`; hybridflow's own plans pass none).
    """

    graph: Graph
    models: Mapping[str, ModelSpec]
    workload: Workload
    cluster: Cluster
    _: KW_ONLY
    settings: RunSettings | None = None
    calibration: Calibration | None = None
    support: Mapping[str, LayoutSupport] = field(default_factory=dict)
    agent: AgentWorkload | None = None
    lora: LoraPlan | Mapping[str, LoraPlan] | None = None
    shared_weights: Mapping[str, str] = field(default_factory=dict)
    pipeline: str = "sync"
    max_staleness: int | None = None
    stream_chunks: int = 1
    micro_batch_sizes: Mapping[str, int] = field(default_factory=dict)
    token_budgets: Mapping[str, int] = field(default_factory=dict)
    overlay: ControllerOverlay | None = None

    def __post_init__(self) -> None:
        check_choice(self.pipeline, self.max_staleness, self.stream_chunks, key=lambda name: f"PlanRequest.{name}")
        if self.shared_weights and self.lora is None:
            raise ValueError(f"PlanRequest.shared_weights={dict(self.shared_weights)!r} needs lora: a role runs on "
                             "another's weights only when that one trains an adapter on its frozen base")
        if self.stream_chunks > self.workload.batch_size:
            raise ValueError(f"PlanRequest.stream_chunks={self.stream_chunks} exceeds the {self.workload.batch_size} "
                             f"prompts of a step (a chunk holds whole prompts); use at most {self.workload.batch_size}")
        for name, budget in self.token_budgets.items():
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(f"PlanRequest.token_budgets[{name!r}]={budget!r} must be a positive number of tokens "
                                 "per micro batch and GPU (leave the role out for row micro batches)")

    def adapters(self) -> dict[str, LoraPlan]:
        """Per trainable role, the LoRA adapter it trains (``lora`` resolved against the graph)."""
        return role_adapters(self.graph, self.lora)

    def problem(self, *, detach: Collection[str] = (), pipeline: str = "sync", max_staleness: int | None = None,
                adapters: Mapping[str, LoraPlan] | None = None, shared_weights: Mapping[str, str] | None = None,
                max_tp: int | None = None, workload: Workload | None = None, streamed: bool = False) -> Problem:
        """The problem one candidate mode costs: this request with the mode (``pipeline``, ``max_staleness``,
        the detached policies), the adapters and shared weights the entry tries, and another ``workload`` for a
        streamed chunk's rows; ``streamed``: cost ``stream_chunks`` (a hand-written mapping's step)."""
        return build_problem(self.graph, self.models, workload or self.workload, self.cluster, detach=detach,
                             max_tp=max_tp, settings=self.settings, calibration=self.calibration, pipeline=pipeline,
                             max_staleness=max_staleness, stream_chunks=self.stream_chunks if streamed else 1,
                             support=self.support, micro_batch_sizes=self.micro_batch_sizes,
                             token_budgets=self.token_budgets, agent=self.agent, adapters=adapters,
                             shared_weights=shared_weights, overlay=self.overlay)
