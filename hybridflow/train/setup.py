"""Turn a :class:`TrainConfig` into the pieces a run needs: model dir, graph, plan, specs, data, reward.

About 400 lines: each piece is a short function from the config, and :mod:`.prepare` calls them in order; the
data and reward pieces are where the config's ``data.*`` keys meet the data layer (``keys_at``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridflow.agents.protocols import ToolUser
from hybridflow.data import (
    DataSpec,
    DataSplits,
    PreparedRecords,
    PromptLoader,
    RewardScorer,
    char_tokenizer,
    hold_out,
    load_splits,
    prepare_records,
    task_examples,
)
from hybridflow.data import reward_scorer as load_reward_scorer
from hybridflow.data.dataset import Record
from hybridflow.data.images import has_images
from hybridflow.data.preference import PreferenceLoader, load_preference_records, preference_task_examples
from hybridflow.data.reward_pool import reward_timeout
from hybridflow.data.splits import DataFiles, load_files
from hybridflow.graph import Graph, Op, RoleKind, load_graph, with_detached_logprobs
from hybridflow.graph.agents import with_environment
from hybridflow.graph.loading import takes_option
from hybridflow.models.tokenizer import PLAIN_CHAT_TEMPLATE, WIDE_ALPHABET, load_tokenizer
from hybridflow.planner import LayoutSupport, Plan, detachable_policies, rollout_role
from hybridflow.registry import ALGORITHMS, BACKENDS, ENVIRONMENTS
from hybridflow.runtime import RoleSpec, default_plan
from hybridflow.runtime.checks import check_layouts, role_support
from hybridflow.runtime.executor import Executor, LocalExecutor
from hybridflow.runtime.limits import RequestLimiter, RewardCache
from hybridflow.runtime.placement import rollout_spec, with_rollout_specs
from hybridflow.runtime.service import RoleServices
from hybridflow.train.aliases import check_algorithm_options
from hybridflow.train.config import RoleConfig, TrainConfig
from hybridflow.train.schema import keys_at


def max_prompt_tokens(data: list[Record], tokenizer: Any) -> int:
    """The longest prompt in tokens, for the planner's workload."""
    return max(len(tokenizer(record["prompt"])["input_ids"]) for record in data[:512])


def data_splits(config: TrainConfig, *, rewards_given: bool = False, pairs: bool = False) -> DataSplits:
    """Train and validation records: files (``data.path``, which needs ``data.reward`` or reward functions given
    as objects: ``rewards_given``) or a built-in task. ``pairs``: preference records for a graph that trains on
    pairs (``Graph.reads_pairs``): rows with ``chosen`` and ``rejected`` (no reward needed), or the task's
    rule-built pairs."""
    with keys_at("data."):
        if pairs:
            return _preference_splits(config)
        return _data_splits(config, rewards_given=rewards_given)


def _preference_splits(config: TrainConfig) -> DataSplits:
    data = config.data
    if data.path:
        files = {f.name: getattr(data, f.name) for f in dataclasses.fields(DataFiles)}
        return load_splits(DataSpec(path=data.path, seed=config.seed, **files), prefix="data.",
                           reader=load_preference_records)
    train = preference_task_examples(data.task, data.num_examples, seed=config.seed)
    if data.val_path:
        return DataSplits(train=train, validation=load_files(data.val_path, data, split=data.val_split,
                                                             field="data.val_path", reader=load_preference_records))
    if data.val_fraction:
        train, validation = hold_out(train, data.val_fraction, seed=config.seed)
        return DataSplits(train=train, validation=validation)
    return DataSplits(train=train, validation=[])


def check_reward_configured(*, data_path: str | None, reward: object) -> None:
    """A data file has no built-in rule: refuse ``data.path`` without ``data.reward``, naming the key."""
    if data_path and not reward:
        raise ValueError(f"data.path is set ({data_path}) but data.reward is not: rows from a file have no "
                         "built-in rule, so name one (data.reward: math, or path/to/file.py:function, or a list "
                         "of them with data.reward_weights)")


def _data_splits(config: TrainConfig, *, rewards_given: bool) -> DataSplits:
    data = config.data
    if data.path:
        check_reward_configured(data_path=str(data.path), reward=data.reward or rewards_given)
        files = {f.name: getattr(data, f.name) for f in dataclasses.fields(DataFiles)}
        return load_splits(DataSpec(path=data.path, seed=config.seed, **files), prefix="data.")
    train = task_examples(data.task, data.num_examples, seed=config.seed)
    if data.val_path:
        return DataSplits(train=train, validation=load_files(data.val_path, data, split=data.val_split,
                                                             field="data.val_path"))
    if data.val_fraction:
        train, validation = hold_out(train, data.val_fraction, seed=config.seed)
        return DataSplits(train=train, validation=validation)
    return DataSplits(train=train, validation=[])


def records(config: TrainConfig) -> list[Record]:
    return data_splits(config).train


def policy_tokenizer(config: TrainConfig) -> Any:
    """``model.path``'s tokenizer, or the tiny model's character tokenizer (wide, with a plain chat template,
    when prompts come from a file or trajectories hold tool calls: they use more than the tasks' characters)."""
    if config.model.path:
        return load_tokenizer(config.model.path)
    if config.data.path or config.agent.environment:
        return char_tokenizer(WIDE_ALPHABET, chat_template=PLAIN_CHAT_TEMPLATE)
    return char_tokenizer()


def policy_processor(config: TrainConfig) -> Any | None:
    """``model.path``'s processor (a vision-language model's), its images resized to between
    ``data.vision.min_pixels`` and ``data.vision.max_pixels``; None for a model without one."""
    path = config.model.path
    if not path or not (Path(path) / "preprocessor_config.json").is_file():
        return None
    from hybridflow.models.vision import load_processor

    vision = config.data.vision
    with keys_at("data.vision."):
        return load_processor(path, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)


def prepare_data(config: TrainConfig, splits: DataSplits, tokenizer: Any) -> tuple[PreparedRecords,
                                                                                  PreparedRecords | None]:
    """Chat prompts rendered, over-long prompts dropped and counted, for training and validation; rows with images
    are read with the policy's processor (``data.vision``)."""
    limit = config.data.max_prompt_length
    tools = agent_tool_schemas(config)
    vision: dict[str, Any] = {}
    if has_images(splits.train) or has_images(splits.validation):
        vision = {"processor": policy_processor(config), "bad_images": config.data.vision.bad_images}
    with keys_at("data."):
        train = prepare_records(splits.train, tokenizer, max_prompt_length=limit, tools=tools, **vision)
        validation = (prepare_records(splits.validation, tokenizer, max_prompt_length=limit, name="validation",
                                      tools=tools, **vision) if splits.validation else None)
    return train, validation


def agent_tool_schemas(config: TrainConfig) -> list[dict[str, Any]] | None:
    """The function schemas of the run's environment's tools, for chat prompts (``agent.tools_in_prompt``): an
    environment built once here, with the run's options, is asked for them (None: no tools to list)."""
    agent = config.agent
    if agent.environment is None or not agent.tools_in_prompt:
        return None
    environment = ENVIRONMENTS.get(agent.environment)(**agent.options)
    try:
        return list(environment.tool_schemas()) if isinstance(environment, ToolUser) else None
    finally:
        environment.close()


def prepare_model(config: TrainConfig, run_dir: Path, data: list[Record],
                  tokenizer: Any | None = None) -> tuple[str, Any]:
    """The initial policy directory and its tokenizer: ``model.path``, or a tiny model SFT-warmed once per run.

    ``tokenizer``: the policy's (:func:`policy_tokenizer`), loaded here when not given.
    """
    if config.model.path:
        return str(Path(config.model.path).resolve()), tokenizer or load_tokenizer(config.model.path)
    from hybridflow.models import build_tiny_causal_lm, save_model_dir
    from hybridflow.train.sft import sft_warm_start

    tokenizer = tokenizer or policy_tokenizer(config)
    target = run_dir.resolve() / "init_model"
    recipe = {"name": config.model.name, "sft_steps": config.model.sft_steps, "seed": config.seed,
              "batch_size": config.model.sft_batch_size, "lr": config.model.sft_lr, "vocab": len(tokenizer),
              "data": json.loads(json.dumps(data[:4], default=str))}
    marker = target / "hybridflow_init.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:  # reuse on resume / rerun
        return str(target), load_tokenizer(target)
    model = build_tiny_causal_lm(config.model.name, vocab_size=len(tokenizer), seed=config.seed)
    if config.model.sft_steps:
        sft_warm_start(model, tokenizer, data, steps=config.model.sft_steps, batch_size=config.model.sft_batch_size,
                       lr=config.model.sft_lr, seed=config.seed, progress=config.logging.progress)
    save_model_dir(model, tokenizer, target)
    marker.write_text(json.dumps(recipe))
    return str(target), tokenizer


def build_graph(config: TrainConfig) -> Graph:
    factory = ALGORITHMS.get(config.algorithm.name)
    # A graph with a reward role scores with the data's reward functions; one without (an LLM judge's) takes none.
    reward: dict[str, Any] = {"reward_kind": RoleKind.REWARD_FUNCTION} if takes_option(config.algorithm.name,
                                                                                          "reward_kind") else {}
    options = {**reward, **config.algorithm.options}
    # An option the algorithm does not take (a verl/TRL name...) is named, not the factory's raw TypeError.
    check_algorithm_options(factory, options, config.algorithm.name)
    graph = with_agent(config, load_graph(config.algorithm.name, **options))
    return with_detached_logprobs(graph, single_pass_roles(config, graph))


def single_pass_roles(config: TrainConfig, graph: Graph) -> frozenset[str]:
    """The policies whose update is one optimizer step on the rollout's own weights, so their old log-probs are the
    update's own, detached (:func:`~hybridflow.graph.skipping.with_detached_logprobs`): ``skip_known_passes`` on,
    a synchronous step (``pipeline: sync``; an overlapped mode trains on rows an older policy sampled, and ``auto``
    is not known until the plan), ``optim.actor.epochs`` 1 and ``optim.actor.mini_batches`` 1."""
    if not config.pipeline.skip_known_passes or config.pipeline.mode != "sync":
        return frozenset()
    if config.optim.actor.epochs != 1 or config.optim.actor.mini_batches != 1:
        return frozenset()
    return frozenset(role.name for role in graph.roles if role.kind is RoleKind.POLICY)


def with_agent(config: TrainConfig, graph: Graph) -> Graph:
    """``graph`` made multi-turn as the config's ``agent`` section says (unchanged without an environment)."""
    agent = config.agent
    if agent.environment is None:
        return graph
    return with_environment(graph, agent.environment, env_options=agent.options, max_turns=agent.max_turns,
                            max_turn_tokens=agent.max_turn_tokens,
                            schedule=None if agent.schedule == "auto" else agent.schedule,
                            env_reward_weight=agent.env_reward_weight)


def build_plan(config: TrainConfig, graph: Graph, prompt_len: int = 32, model_dir: str | None = None, *,
               vocab_size: int | None = None, image_tokens: int = 0, template_tokens: int | None = None) -> Plan:
    """The plan file's, the planner's (``placement``) or the one-group plan; the run then executes it as it is.

    Every plan holds the micro batches the user fixed and only layouts the roles' backends run (refused here,
    before any model loads). ``model_dir``: the run's starting weights, which the planner sizes the models by
    (before they exist, a built-in tiny model is sized by its config and ``vocab_size``, the tokenizer's).
    ``prompt_len`` counts a prompt's text tokens, ``image_tokens`` its images' visual tokens (a VLM's),
    ``template_tokens`` what a judge's template adds to a judge prompt (``train.template_tokens``).
    """
    fixed, budgets = fixed_micro_batches(config, graph), token_budgets(config)
    if config.placement.plan_file:
        plan = Plan.from_json(Path(config.placement.plan_file).read_text())
        _check_plan_file_agrees(plan, fixed, budgets)
    elif config.placement.mode != "default":
        from hybridflow.train.placement import planned

        plan = planned(config, graph, prompt_len, model_dir, support=layout_support(config, graph),
                       micro_batch_sizes=fixed, token_budgets=budgets, vocab_size=vocab_size,
                       image_tokens=image_tokens, template_tokens=template_tokens)
    else:
        plan = default_plan(graph, num_gpus=config.placement.num_gpus, micro_batch_sizes=fixed,
                            token_budgets=budgets, padding=config.pipeline.padding)
    check_role_entries(config, graph, plan)
    check_layouts(graph, plan, with_rollout_specs(plan, role_specs(config, graph, _PLANNING_MODEL, plan)))
    return plan


def check_given_plan(config: TrainConfig, graph: Graph, plan: Plan,
                     specs: Mapping[str, RoleSpec] | None = None) -> None:
    """A caller's own plan (and specs): the config's role entries name its roles, its layouts are ones the
    roles' backends run."""
    check_role_entries(config, graph, plan)
    given = specs if specs is not None else role_specs(config, graph, _PLANNING_MODEL, plan)
    check_layouts(graph, plan, with_rollout_specs(plan, given))


_PLANNING_MODEL = "<the run's starting weights>"  # what specs name before the policy's directory exists


def fixed_micro_batches(config: TrainConfig, graph: Graph) -> dict[str, int]:
    """The micro batches the user fixed, per GPU role: ``roles.<name>.micro_batch_size``, else the role's
    optimisation section's (``critic`` for value models, ``actor`` for every other role). The plan takes them
    as given; roles without one are the planner's (or the one-group plan's) to choose."""
    fixed = {}
    for role in graph.roles:
        if not role.kind.needs_gpu:
            continue
        entry = config.roles.get(role.name, RoleConfig())
        optim = config.optim.of(role.kind is RoleKind.VALUE)
        size = entry.micro_batch_size or optim.micro_batch_size
        if size:
            fixed[role.name] = size
    return fixed


def token_budgets(config: TrainConfig) -> dict[str, int]:
    """The token budgets per micro batch and GPU the user fixed (``roles.<name>.max_tokens_per_micro_batch``)."""
    return {name: entry.max_tokens_per_micro_batch for name, entry in config.roles.items()
            if entry.max_tokens_per_micro_batch}


def _check_plan_file_agrees(plan: Plan, fixed: Mapping[str, int], budgets: Mapping[str, int]) -> None:
    """A plan file is executed as it is: a micro batch or token budget the config also fixes must be the file's."""
    for role in sorted(set(fixed) | set(budgets)):
        if role not in plan.roles or plan.group_index(role) is None:
            continue
        layout, hint = plan.layout(role), "a plan file is executed as it is: drop the key or write the plan with"
        if role in fixed and layout.micro_batch_size != fixed[role]:
            raise ValueError(f"config key 'roles.{role}.micro_batch_size' (or actor/critic.micro_batch_size)="
                             f"{fixed[role]} disagrees with the plan file's {layout.micro_batch_size}; {hint} that "
                             "micro batch")
        budget = budgets.get(role)
        if budget is not None and (layout.max_tokens_per_micro_batch,
                                   layout.forward_max_tokens_per_micro_batch) != (budget, budget):
            raise ValueError(f"config key 'roles.{role}.max_tokens_per_micro_batch'={budget} disagrees with the plan "
                             f"file's layout (max_tokens_per_micro_batch={layout.max_tokens_per_micro_batch}, "
                             f"forward_max_tokens_per_micro_batch={layout.forward_max_tokens_per_micro_batch}); "
                             f"{hint} that budget")


def layout_support(config: TrainConfig, graph: Graph) -> dict[str, LayoutSupport]:
    """What each GPU role's backend runs as planned, and each detachable policy's rollout were it detached
    (``actor:rollout``: the vLLM backend for ``rollout: vllm``, else the policy's): the planner searches that."""
    policies = detachable_policies(graph)
    specs = role_specs(config, graph, _PLANNING_MODEL, detached=policies)
    return {name: role_support(spec) for name, spec in specs.items()}


def check_role_entries(config: TrainConfig, graph: Graph, plan: Plan) -> None:
    """Each ``roles.<name>`` entry names a role of the graph (or a detached rollout of the plan) that runs on
    GPUs, and an installed backend."""
    _check_roles(config, graph)
    for name, entry in config.roles.items():
        if name not in plan.roles:
            raise KeyError(f"config key 'roles.{name}': the plan has no role {name!r} (its roles: {list(plan.roles)}); "
                           "a policy's rollout role exists only when the plan gives it GPUs of its own")
        if entry.backend is None:
            continue
        BACKENDS.get(entry.backend)  # an unknown name lists the installed backends
        if plan.group_index(name) is None:
            raise ValueError(f"config key 'roles.{name}.backend': role {name!r} runs on the driver (a reward "
                             "function), so it has no backend; remove the key")


def _check_roles(config: TrainConfig, graph: Graph) -> None:
    rollouts = {rollout_role(role.name) for role in graph.roles if role.kind.trainable}
    for name in config.roles:
        if name not in graph.role_names and name not in rollouts:
            raise KeyError(f"config key 'roles.{name}': the {graph.name} graph has no role {name!r}; "
                           f"its roles are {graph.role_names}")


def services(config: TrainConfig, plan: Plan) -> RoleServices | None:
    """The reward cache and per-role request bounds the config asks for, or None."""
    limiters = {name: RequestLimiter(role.max_concurrent_requests) for name, role in config.roles.items()
                if role.max_concurrent_requests}
    if not limiters and not config.data.reward_cache_size:
        return None
    rows = {}
    for name in limiters:
        if plan.group_index(name) is None:
            rows[name] = 0
        else:  # a request is one micro batch on every rank
            rows[name] = plan.layout(name).micro_batch_size * plan.layout(name).dp
    cache = RewardCache(config.data.reward_cache_size) if config.data.reward_cache_size else None
    return RoleServices(reward_cache=cache, limiters=limiters, request_rows=rows)


def role_specs(config: TrainConfig, graph: Graph, model_dir: str, plan: Plan | None = None, *,
               detached: Iterable[str] = ()) -> dict[str, RoleSpec]:
    """A spec per GPU role: trainable policies use ``actor``, value models ``critic`` settings.

    A detached rollout of a policy in ``detached`` or ``plan`` with a ``roles.<policy>:rollout`` entry gets
    its own spec (the policy's model, the entry's backend and options); without one it is derived from the
    policy (:func:`~hybridflow.runtime.placement.rollout_spec`), here when named in ``detached``, else by the
    controller. How each role runs (micro batches...) is the plan's layout, not the spec's.
    """
    specs = {}
    for role in graph.roles:
        if not role.kind.needs_gpu:
            continue
        optim = config.optim.of(role.kind is RoleKind.VALUE)
        entry = config.roles.get(role.name, RoleConfig())
        if entry.lora is not None and role.kind is not RoleKind.POLICY:
            critic = (" (a critic's value head is new, so it would train in full beside the adapters: LoRA critics "
                      "are not supported; train the critic fully)") if role.kind is RoleKind.VALUE else ""
            raise ValueError(f"config key 'roles.{role.name}.lora': role {role.name!r} is a {role.kind} role; LoRA "
                             f"adapters train on a trainable policy (e.g. roles.actor.lora){critic}, remove the key")
        if entry.freeze_vision_tower and not role.kind.trainable:
            raise ValueError(f"config key 'roles.{role.name}.freeze_vision_tower': role {role.name!r} is a "
                             f"{role.kind} role, which trains nothing; the key is for a trainable role (e.g. "
                             "roles.actor.freeze_vision_tower), remove it")
        specs[role.name] = RoleSpec(name=role.name, kind=role.kind, model=entry.model or model_dir,
                                    backend=entry.backend or "torch", seed=config.seed,
                                    optim=optim.spec(config.steps) if role.kind.trainable else None,
                                    options=entry.options, rollout=entry.rollout,
                                    rollout_options=entry.rollout_options, lora=entry.lora,
                                    freeze_vision_tower=entry.freeze_vision_tower)
    specs.update({name: replace(specs[name], shares_policy=policy)
                  for name, policy in shared_references(graph, specs).items()})
    policies = [*detached, *(plan.detached_rollouts if plan is not None else {})]
    for policy in dict.fromkeys(policies):
        rollout = rollout_role(policy)
        derived = rollout_spec(specs[policy], rollout)
        if rollout in config.roles:
            entry = config.roles[rollout]
            if entry.lora is not None:
                raise ValueError(f"config key 'roles.{rollout}.lora': a rollout generates with its policy's weights "
                                 f"(merged adapters); set roles.{policy}.lora instead")
            if entry.freeze_vision_tower:
                raise ValueError(f"config key 'roles.{rollout}.freeze_vision_tower': a rollout trains nothing; set "
                                 f"roles.{policy}.freeze_vision_tower instead")
            specs[rollout] = replace(derived, model=entry.model or derived.model,
                                     backend=entry.backend or derived.backend,
                                     options=entry.options or derived.options,
                                     rollout_options=entry.rollout_options or derived.rollout_options)
        elif policy in detached:
            specs[rollout] = derived
    return specs


def shared_references(graph: Graph, specs: Mapping[str, RoleSpec]) -> dict[str, str]:
    """``{reference: policy}`` for each frozen role that is a LoRA policy's base model: the same ``model``, only
    ``logprob``/``ref_logprob`` nodes, adapters whose init leaves the base as it was (``AdapterSpec.keeps_base``).
    Such a reference runs on the policy's engine with adapters disabled (``RoleSpec.shares_policy``), so the
    plan places it on the policy's group and counts no weights for it."""
    policies = [spec for spec in specs.values() if spec.kind is RoleKind.POLICY and spec.lora is not None
                and spec.lora.keeps_base]
    ops = graph.ops_by_role()
    shared = {}
    for spec in specs.values():
        if spec.kind is not RoleKind.FROZEN_POLICY or not ops.get(spec.name, frozenset()) <= {Op.LOGPROB,
                                                                                              Op.REF_LOGPROB}:
            continue
        bases = [policy.name for policy in policies if policy.model == spec.model]
        if len(bases) == 1:
            shared[spec.name] = bases[0]
    return shared


REWARD_TIMEOUT_KEY = "data.reward_timeout_s"
REWARD_SERVICE_KEYS = "data.reward_service."


def reward_scorer(config: TrainConfig, tokenizer: Any, given: Sequence[Any] | None = None) -> RewardScorer:
    """``data.reward`` (one function or a weighted list), else the built-in task's rule; signatures checked now.
    The functions run in worker processes under ``data.reward_timeout_s``, started by the first score; reward
    services (URLs) in this process, as ``data.reward_service`` says. ``given``:
    functions as objects instead (in-process when a worker cannot load one: ``reward_pool.reward_timeout``)."""
    with keys_at("data."):
        if given is not None:
            return load_reward_scorer(list(given), tokenizer, weights=config.data.reward_weights,
                                      timeout_s=reward_timeout(list(given), config.data.reward_timeout_s),
                                      timeout_name=REWARD_TIMEOUT_KEY)
        rewards = config.data.task if config.data.reward is None else config.data.reward  # [] is refused
        return load_reward_scorer(rewards, tokenizer, weights=config.data.reward_weights,
                                  timeout_s=config.data.reward_timeout_s, timeout_name=REWARD_TIMEOUT_KEY,
                                  service=config.data.reward_service, service_prefix=REWARD_SERVICE_KEYS)


def prompt_loader(config: TrainConfig, data: list[Record], tokenizer: Any,
                  graph: Graph | None = None) -> PromptLoader | PreferenceLoader:
    """Each step's rows: prompts, or a graph's preference pairs (``Graph.reads_pairs``), ``data.batch_size`` a step."""
    if graph is not None and graph.reads_pairs:
        return PreferenceLoader(records=data, tokenizer=tokenizer, batch_size=config.data.batch_size,
                                seed=config.seed)
    processor = policy_processor(config) if has_images(data) else None
    return PromptLoader(records=data, tokenizer=tokenizer, batch_size=config.data.batch_size, seed=config.seed,
                        processor=processor)


def make_executor(config: TrainConfig) -> Executor:
    if config.executor.name == "ray":
        from hybridflow.runtime.ray_executor import RayExecutor

        return RayExecutor(address=config.executor.ray_address, liveness=config.executor.liveness)
    if config.executor.name == "torchrun":
        from hybridflow.runtime.torchrun_executor import TorchrunExecutor

        # The world torchrun started (examples/train_ppo.py joins it); records which process ran which role.
        return TorchrunExecutor(info_path=str(Path(config.output_dir) / "torchrun_workers.json"),
                                liveness=config.executor.liveness)
    return LocalExecutor()
