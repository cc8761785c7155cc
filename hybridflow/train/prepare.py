"""Compose a run's values once: ``prepare_run(config) -> PreparedRun``, which `hybridflow train`, the classic
API (through :func:`~hybridflow.train.loop.train`) and scripts share.

The order is the contract: the graph, the config's checks, the data and tokenizer, the prompts' checks, the
roles' tokenizers (a teacher's or reference's own model shares the policy's), the rewards' checks, then the plan,
made once with the real prompt lengths and checked against the roles' backends. All of it happens before a run
directory is written or a model loads; the step loop then executes exactly the plan it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.data import PreparedRecords, RewardScorer
from hybridflow.graph import Graph
from hybridflow.graph.agents import with_schedule
from hybridflow.planner import Plan
from hybridflow.runtime import RoleSpec
from hybridflow.train import setup
from hybridflow.train.config import TrainConfig
from hybridflow.train.preflight import check_config, check_prompts, check_vocabulary, probe_rewards
from hybridflow.train.role_tokenizers import check_role_tokenizers
from hybridflow.train.template_tokens import template_tokens


@dataclass(frozen=True, kw_only=True)
class PreparedRun:
    """What a run executes, composed once from its config (the policy's weights come at run start)."""

    config: TrainConfig
    graph: Graph
    plan: Plan
    tokenizer: Any
    train_data: PreparedRecords
    validation_data: PreparedRecords | None
    scorer: RewardScorer
    given_specs: Mapping[str, RoleSpec] | None = None  # a caller's own specs, executed as given

    def role_specs(self, model_dir: str) -> dict[str, RoleSpec]:
        """A spec per GPU role once the policy's starting weights are in ``model_dir``."""
        if self.given_specs is not None:
            return dict(self.given_specs)
        return setup.role_specs(self.config, self.graph, model_dir, self.plan)


def prepare_run(config: TrainConfig, *, graph: Graph | None = None, plan: Plan | None = None,
                specs: Mapping[str, RoleSpec] | None = None, note: Any = None,
                rewards: Sequence[Any] | None = None) -> PreparedRun:
    """Build and check everything ``config`` names, planning once (see the module).

    ``graph``, ``plan`` and ``specs``: a caller's own values (the classic API, a notebook), executed as they
    are (a given plan is still checked against the roles' backends). ``note``: a progress callback.
    ``rewards``: reward functions as objects (callables or specs), in place of ``data.reward``.
    """
    if rewards is not None and config.data.reward is not None:
        raise ValueError("reward functions given both as objects and in config key 'data.reward'; give one")
    graph = graph or setup.build_graph(config)
    check_config(config, graph, plan)  # config-only checks, before anything is read
    splits = setup.data_splits(config, rewards_given=rewards is not None, pairs=graph.reads_pairs)
    if note is not None:
        note(f"preparing {len(splits.train)} prompts")
    tokenizer = setup.policy_tokenizer(config)
    check_vocabulary(config, tokenizer)
    train_data, validation = setup.prepare_data(config, splits, tokenizer)
    check_prompts(config, graph, train_data.records, tokenizer, train_data.longest_prompt_tokens)
    check_role_tokenizers(config, graph, tokenizer, [str(record["prompt"]) for record in train_data.records[:8]])
    scorer = setup.reward_scorer(config, tokenizer, rewards)  # its worker processes start at the probe, serve the run
    try:
        probe_rewards(config, train_data.records, tokenizer, scorer)
        if plan is None:
            # the planner counts a prompt's text and its images' visual tokens apart (Workload.image_tokens)
            text_tokens = max(1, train_data.longest_prompt_tokens - train_data.image_tokens)
            plan = setup.build_plan(config, graph, text_tokens, config.model.path, vocab_size=len(tokenizer),
                                    image_tokens=train_data.image_tokens,
                                    template_tokens=template_tokens(config, graph, tokenizer, train_data.records))
        else:
            setup.check_given_plan(config, graph, plan, specs)
    except BaseException:
        scorer.close()
        raise
    graph = with_schedule(graph, plan.mode.agent_schedule)  # multi-turn nodes run the schedule the plan costed
    return PreparedRun(config=config, graph=graph, plan=plan, tokenizer=tokenizer, train_data=train_data,
                       validation_data=validation, scorer=scorer, given_specs=specs)
