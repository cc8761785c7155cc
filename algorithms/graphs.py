"""The built-in algorithms, each a short graph. Maths lives in :mod:`hybridflow.algorithms.core`.

Every factory takes keyword options and returns a validated :class:`~hybridflow.graph.Graph`.
``reward_kind`` chooses a reward model (a network to place on GPUs) or a reward function (a rule).
The actor's loss options (``clip_ratio_high``, ``loss_agg``, ``entropy_coef``) reach the update node,
and the sampling options ``top_p``/``top_k`` the generate node, only when they differ from their defaults,
so a graph built with default options stays as it was. ``rollout_correction`` (``tis`` or ``decoupled``, capped at
``rollout_is_cap``) asks the sampling generate node for ``logprobs`` and feeds its ``rollout_logprobs`` to the
actor's ``ppo_policy`` update (:mod:`hybridflow.algorithms.offpolicy`). The sampling generate node writes
``loss_mask`` (``response_mask`` unless the rollout engine masks tokens, e.g. a multi-turn rollout's tool outputs)
and every advantage, KL-in-reward and update node reads it where it means the tokens trained on; the score node
and DAPO's overlong shaping read ``response_mask`` (what was decoded, and how long it is).
Every graph is built without the forward passes nothing reads (``GraphBuilder.build(prune_unread=True)``): with
``kl_coef: 0`` (and no ``kl_target``) no KL term reads the reference's log-probs, so the reference pass and role
are skipped (recorded in ``Graph.skipped``) and never loaded.
This module imports no torch, so listing or planning algorithms stays fast. It is over 400 lines because it holds
every built-in algorithm, one short factory each, read side by side (what differs between PPO, GRPO and RLOO is
a few lines apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.algorithms.modes import (
    LOSS_AGGS,
    ROLLOUT_CORRECTIONS,
    SCALE_REWARDS,
    LossAgg,
    RolloutCorrection,
    ScaleRewards,
    check_choice,
)
from hybridflow.algorithms.teacher import add_teacher_kl, advantages_field

from hybridflow.graph import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, Graph, GraphBuilder, RoleKind
from hybridflow.registry import ALGORITHMS

SEQ = ("prompts", "responses", "response_mask")
# What an update reads: the sequences (attention, padding) and the loss mask (the tokens its loss trains on).
TRAINED = (*SEQ, "loss_mask")
# Any, not the graph's Scalar: mypy cannot tell that ** into ``update`` never fills its ``name`` parameter.
Options = dict[str, Any]


def _policy_roles(g: GraphBuilder, reward_kind: RoleKind | str) -> tuple[str, str, str]:
    return (g.role("actor", RoleKind.POLICY), g.role("reference", RoleKind.FROZEN_POLICY),
            g.role("reward", reward_kind))


def _kl_rewards(g: GraphBuilder, kl_coef: float, scores: str = "scores", kl_target: float | None = None,
                kl_horizon: float = 10000.0) -> None:
    """KL-in-reward; with ``kl_target`` the coefficient adapts to keep the KL near it (starting at ``kl_coef``).
    A fixed ``kl_coef`` of 0 penalises nothing: the scores become token rewards without reading the reference's
    (or the actor's) log-probs, so the graph's build skips those passes (:func:`_build`)."""
    if not kl_coef and kl_target is None:
        g.compute("token_rewards", fn="token_rewards", inputs=(scores, "loss_mask"), outputs=("token_rewards",))
        return
    adaptive: Options = {"kl_target": kl_target, "kl_horizon": kl_horizon} if kl_target is not None else {}
    g.compute("kl_rewards", fn="kl_penalized_rewards", inputs=(scores, "old_logprobs", "ref_logprobs", "loss_mask"),
              outputs=("token_rewards",), kl_coef=kl_coef, **adaptive)


def _build(g: GraphBuilder, kl_coef: float | None, kl_target: float | None = None) -> Graph:
    """The graph, without the forward passes nothing reads (:func:`~hybridflow.graph.skipping.prune_unread`):
    with a fixed ``kl_coef`` of 0 no node reads the reference's log-probs, and the reference is not loaded
    (TRL's ``beta: 0``)."""
    why = "kl_coef=0" if not kl_coef and kl_target is None else ""
    return g.build(prune_unread=True, why=why)


def _actor_options(clip_ratio: float, clip_ratio_high: float | None = None, loss_agg: LossAgg = "token-mean",
                   entropy_coef: float = 0.0, **extra: str | int | float | bool | None) -> Options:
    """The actor loss's options, leaving out those at the loss's defaults (see the module docstring)."""
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    options: Options = {"clip_ratio": clip_ratio, **extra}
    if clip_ratio_high is not None:
        options["clip_ratio_high"] = clip_ratio_high
    if loss_agg != "token-mean":
        options["loss_agg"] = loss_agg
    if entropy_coef:
        options["entropy_coef"] = entropy_coef
    return options


@dataclass(frozen=True)
class _Correction:
    """What an off-policy correction adds to a graph (nothing without one): ``logprobs`` on the sampling generate
    node, ``rollout_logprobs`` to the actor update's inputs and the loss options to that update."""

    sampling: Options = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    options: Options = field(default_factory=dict)


DEFAULT_IS_CAP = 2.0


def _correction(rollout_correction: RolloutCorrection | None, rollout_is_cap: float) -> _Correction:
    if rollout_correction is None:
        if rollout_is_cap != DEFAULT_IS_CAP:
            raise ValueError(f"algorithm option rollout_is_cap={rollout_is_cap} applies only with rollout_correction "
                             f"({' or '.join(ROLLOUT_CORRECTIONS)})")
        return _Correction()
    check_choice("rollout_correction", rollout_correction, ROLLOUT_CORRECTIONS)
    if not rollout_is_cap > 0:
        raise ValueError(f"algorithm option rollout_is_cap={rollout_is_cap} must be > 0")
    return _Correction({"logprobs": True}, ("rollout_logprobs",),
                       {"rollout_correction": rollout_correction, "rollout_is_cap": rollout_is_cap})


def check_rollout_correction(graph: Graph) -> None:
    """Raise a ValueError naming the node and option when an update asks for ``rollout_correction`` but does not read
    ``rollout_logprobs`` (the field a generate node with ``logprobs=True`` writes)."""
    for node in graph.nodes:
        mode = node.option("rollout_correction")
        if mode is not None and "rollout_logprobs" not in node.inputs:
            raise ValueError(f"node {node.name!r}: rollout_correction={mode!r} needs the rollout engine's log-probs: "
                             "add 'rollout_logprobs' to its inputs and logprobs=True to the generate node")


def _top(top_p: float, top_k: int) -> Options:
    """Nucleus / top-k sampling options for a generate node, left out at their defaults (1.0: off, 0: off)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"algorithm option top_p={top_p} must be in (0, 1] (1.0: off)")
    if top_k < 0:
        raise ValueError(f"algorithm option top_k={top_k} must be >= 0 (0: off)")
    return {**({"top_p": top_p} if top_p != 1.0 else {}), **({"top_k": top_k} if top_k else {})}


def _sample(g: GraphBuilder, actor: str, *, n: int, temperature: float, max_new_tokens: int,
            mask_truncated: bool = False, **sampling: Any) -> None:
    """The sampling generate node; with ``mask_truncated`` (TRL's ``mask_truncated_completions``) its loss mask
    passes through a ``mask_truncated`` node that zeroes the responses cut at ``max_new_tokens``."""
    if not mask_truncated:
        g.generate(actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens, loss_mask=True, **sampling)
        return
    outputs = ("responses", "response_mask", *(("rollout_logprobs",) if sampling.get("logprobs") else ()),
               "sampled_loss_mask")
    g.generate(actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens, loss_mask=True, outputs=outputs,
               **sampling)
    g.compute("mask_truncated", fn="mask_truncated", inputs=("sampled_loss_mask", "response_mask"),
              outputs=("loss_mask",), max_new_tokens=max_new_tokens)


def _rollout(name: str, *, n: int, reference: bool, temperature: float, max_new_tokens: int,
             reward_kind: RoleKind | str, sampling: Options | None = None,
             mask_truncated: bool = False) -> tuple[GraphBuilder, str]:
    """A graph that samples ``n`` responses per prompt, scores them and takes their old (and reference) log-probs."""
    g = GraphBuilder(name)
    actor = g.role("actor", RoleKind.POLICY)
    ref = g.role("reference", RoleKind.FROZEN_POLICY) if reference else None
    reward = g.role("reward", reward_kind)
    _sample(g, actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens, mask_truncated=mask_truncated,
            **(sampling or {}))
    g.score(reward)
    if ref is not None:
        g.ref_logprob(ref)
    g.logprob(actor)
    return g, actor


def _group_relative(g: GraphBuilder, actor: str, *, n: int, norm_by_std: bool, loss: str, kl_coef: float | None,
                    options: Options, correction: _Correction | None = None,
                    scale_rewards: ScaleRewards = "group", teacher_kl_coef: float = 0.0) -> Graph:
    """GRPO's tail: group-relative advantages (plus a teacher's term with ``teacher_kl_coef``), then the actor's
    update (with a KL term when ``kl_coef`` is set)."""
    correction = correction or _Correction()
    check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    if not norm_by_std and scale_rewards != "group":
        raise ValueError(f"algorithm options norm_by_std=False and scale_rewards={scale_rewards!r} conflict: "
                         "norm_by_std=False is scale_rewards='none'; give one")
    scale: Options = {"scale_rewards": scale_rewards} if scale_rewards != "group" else {}
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "loss_mask", "uid"),
              outputs=(advantages_field(teacher_kl_coef),), norm_by_std=norm_by_std, **scale)
    add_teacher_kl(g, teacher_kl_coef)
    options = {**options, **correction.options}
    if not kl_coef:  # None or 0: no KL term, so the update reads no reference log-probs
        g.update(actor, loss=loss, inputs=(*TRAINED, "old_logprobs", *correction.inputs, "advantages"), **options)
    else:
        g.update(actor, loss=loss, inputs=(*TRAINED, "old_logprobs", *correction.inputs, "ref_logprobs", "advantages"),
                 **options, kl_coef=kl_coef, kl_type="low_var_kl")
    return _build(g, kl_coef)


@ALGORITHMS.register("ppo")
def ppo(*, kl_coef: float = 0.05, kl_target: float | None = None, kl_horizon: float = 10000.0, gamma: float = 1.0,
        lam: float = 0.95, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
        loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0, value_clip: float = 0.2,
        temperature: float = DEFAULT_TEMPERATURE, top_p: float = 1.0, top_k: int = 0,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
        teacher_kl_coef: float = 0.0, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """PPO with a critic and GAE; KL to the reference enters the token rewards (adaptive with ``kl_target``).
    ``teacher_kl_coef``: the teacher's term is added to GAE's advantages, not to the critic's returns."""
    g = GraphBuilder("ppo")
    actor, ref, reward = _policy_roles(g, reward_kind)
    critic = g.role("critic", RoleKind.VALUE)
    correction = _correction(rollout_correction, rollout_is_cap)
    g.generate(actor, temperature=temperature, max_new_tokens=max_new_tokens, loss_mask=True, **_top(top_p, top_k),
               **correction.sampling)
    g.score(reward)
    g.ref_logprob(ref)
    g.values(critic)
    g.logprob(actor)
    _kl_rewards(g, kl_coef, kl_target=kl_target, kl_horizon=kl_horizon)
    g.compute("gae", fn="gae", inputs=("token_rewards", "values", "loss_mask"),
              outputs=(advantages_field(teacher_kl_coef), "returns"), gamma=gamma, lam=lam)
    add_teacher_kl(g, teacher_kl_coef)
    g.update(critic, loss="value", inputs=(*TRAINED, "values", "returns"), clip_range=value_clip)
    g.update(actor, loss="ppo_policy", inputs=(*TRAINED, "old_logprobs", *correction.inputs, "advantages"),
             **_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef), **correction.options)
    return _build(g, kl_coef, kl_target)


@ALGORITHMS.register("grpo")
def grpo(*, n: int = 4, kl_coef: float = 0.04, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
         loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0, norm_by_std: bool = True,
         temperature: float = DEFAULT_TEMPERATURE, top_p: float = 1.0, top_k: int = 0,
         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
         rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
         scale_rewards: ScaleRewards = "group", mask_truncated: bool = False, loss_scale_factor: float | None = None,
         teacher_kl_coef: float = 0.0, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """GRPO: group-normalised outcome advantages, KL to the reference as a loss term, no critic.

    ``scale_rewards`` (``group``, ``batch``, ``none``) and ``mask_truncated`` are TRL's ``scale_rewards`` and
    ``mask_truncated_completions``; ``loss_scale_factor`` the constant ``seq-mean-token-sum-norm`` divides by
    (TRL's ``loss_type="dr_grpo"`` is that mode with ``max_new_tokens`` here; docs/algorithms.md).
    ``teacher_kl_coef`` > 0 adds a ``teacher`` role's per-token reverse KL to the advantages
    (:mod:`hybridflow.algorithms.teacher`; every policy-gradient graph here takes it)."""
    correction = _correction(rollout_correction, rollout_is_cap)
    g, actor = _rollout("grpo", n=n, reference=True, temperature=temperature, max_new_tokens=max_new_tokens,
                        reward_kind=reward_kind, sampling={**_top(top_p, top_k), **correction.sampling},
                        mask_truncated=mask_truncated)
    return _group_relative(g, actor, n=n, norm_by_std=norm_by_std, loss="ppo_policy", kl_coef=kl_coef,
                           options=_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef,
                                                  **_scale_factor(loss_agg, loss_scale_factor)),
                           correction=correction, scale_rewards=scale_rewards, teacher_kl_coef=teacher_kl_coef)


def _scale_factor(loss_agg: str, loss_scale_factor: float | None) -> Options:
    """The ``loss_scale_factor`` option (left out unset), read by ``seq-mean-token-sum-norm`` alone."""
    if loss_scale_factor is None:
        return {}
    if loss_agg != "seq-mean-token-sum-norm" or not loss_scale_factor > 0:
        raise ValueError(f"algorithm option loss_scale_factor={loss_scale_factor} is the positive constant of "
                         f"loss_agg='seq-mean-token-sum-norm'; loss_agg is {loss_agg!r}")
    return {"loss_scale_factor": loss_scale_factor}


@ALGORITHMS.register("grpo_no_ref")
def grpo_no_ref(*, n: int = 4, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0, norm_by_std: bool = True,
                temperature: float = DEFAULT_TEMPERATURE, top_p: float = 1.0, top_k: int = 0,
                max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
                scale_rewards: ScaleRewards = "group", mask_truncated: bool = False,
                loss_scale_factor: float | None = None, teacher_kl_coef: float = 0.0,
                reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """GRPO without a reference model: no KL term and no reference role, so nothing is placed for one."""
    correction = _correction(rollout_correction, rollout_is_cap)
    g, actor = _rollout("grpo_no_ref", n=n, reference=False, temperature=temperature, max_new_tokens=max_new_tokens,
                        reward_kind=reward_kind, sampling={**_top(top_p, top_k), **correction.sampling},
                        mask_truncated=mask_truncated)
    return _group_relative(g, actor, n=n, norm_by_std=norm_by_std, loss="ppo_policy", kl_coef=None,
                           options=_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef,
                                                  **_scale_factor(loss_agg, loss_scale_factor)),
                           correction=correction, scale_rewards=scale_rewards, teacher_kl_coef=teacher_kl_coef)


@ALGORITHMS.register("dr_grpo")
def dr_grpo(*, n: int = 4, kl_coef: float = 0.0, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
            entropy_coef: float = 0.0, temperature: float = DEFAULT_TEMPERATURE,
            top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
            rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
            mask_truncated: bool = False, teacher_kl_coef: float = 0.0,
            reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """Dr.GRPO (https://arxiv.org/abs/2503.20783): GRPO without the std normalisation of advantages and with
    each response's token sum divided by a constant (``max_new_tokens``), not its length; no KL (and no
    reference role) unless ``kl_coef`` > 0."""
    correction = _correction(rollout_correction, rollout_is_cap)
    g, actor = _rollout("dr_grpo", n=n, reference=True, temperature=temperature,
                        max_new_tokens=max_new_tokens, reward_kind=reward_kind,
                        sampling={**_top(top_p, top_k), **correction.sampling}, mask_truncated=mask_truncated)
    options = _actor_options(clip_ratio, clip_ratio_high, "seq-mean-token-sum-norm", entropy_coef,
                             loss_scale_factor=max_new_tokens)
    return _group_relative(g, actor, n=n, norm_by_std=False, loss="ppo_policy", kl_coef=kl_coef or None,
                           options=options, correction=correction, teacher_kl_coef=teacher_kl_coef)


@ALGORITHMS.register("gspo")
def gspo(*, n: int = 4, kl_coef: float = 0.0, clip_ratio: float = 3e-4, clip_ratio_high: float = 4e-4,
         loss_agg: LossAgg = "seq-mean-token-mean", entropy_coef: float = 0.0, temperature: float = DEFAULT_TEMPERATURE,
         top_p: float = 1.0, top_k: int = 0,
         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, teacher_kl_coef: float = 0.0,
         reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """GSPO (https://arxiv.org/abs/2507.18071): GRPO's advantages, importance ratio and clipping per sequence
    (the paper's clip range 3e-4 / 4e-4); no KL (and no reference role) unless ``kl_coef`` > 0."""
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    g, actor = _rollout("gspo", n=n, reference=True, temperature=temperature, max_new_tokens=max_new_tokens,
                        reward_kind=reward_kind, sampling=_top(top_p, top_k))
    options: Options = {"clip_ratio": clip_ratio, "clip_ratio_high": clip_ratio_high, "loss_agg": loss_agg,
                        "entropy_coef": entropy_coef}
    return _group_relative(g, actor, n=n, norm_by_std=True, loss="gspo_policy", kl_coef=kl_coef or None,
                           options=options, teacher_kl_coef=teacher_kl_coef)


@ALGORITHMS.register("dapo")
def dapo(*, n: int = 8, clip_ratio: float = 0.2, clip_ratio_high: float = 0.28, entropy_coef: float = 0.0,
         overlong_buffer: int = 0, overlong_penalty: float = 1.0, max_rounds: int = 3,
         temperature: float = DEFAULT_TEMPERATURE,
         top_p: float = 1.0, top_k: int = 0,
         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, rollout_correction: RolloutCorrection | None = None,
         rollout_is_cap: float = DEFAULT_IS_CAP, mask_truncated: bool = False, teacher_kl_coef: float = 0.0,
         reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """DAPO (https://arxiv.org/abs/2503.14476): GRPO without KL or reference, clip-higher, the token-level loss,
    overlong reward shaping over the last ``overlong_buffer`` tokens (0: off) and dynamic sampling: groups whose
    rewards are all equal are dropped and up to ``max_rounds`` more rollouts refill the batch. ``mask_truncated``:
    the paper's overlong filtering (no loss on truncated responses; TRL's ``mask_truncated_completions``)."""
    g = GraphBuilder("dapo")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", reward_kind)
    correction = _correction(rollout_correction, rollout_is_cap)
    _sample(g, actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens, mask_truncated=mask_truncated,
            **_top(top_p, top_k), **correction.sampling)
    g.score(reward, outputs=("raw_scores",) if overlong_buffer else None)
    if overlong_buffer:
        g.compute("overlong_shaping", fn="overlong_penalized_scores", inputs=("raw_scores", "response_mask"),
                  outputs=("scores",), max_response_len=max_new_tokens, buffer_len=overlong_buffer,
                  penalty_factor=overlong_penalty)
    g.filter("dynamic_sampling", fn="groups_with_signal", inputs=("scores", "uid"), max_rounds=max_rounds)
    g.logprob(actor)
    return _group_relative(g, actor, n=n, norm_by_std=True, loss="ppo_policy", kl_coef=None,
                           options=_actor_options(clip_ratio, clip_ratio_high, "token-mean", entropy_coef),
                           correction=correction, teacher_kl_coef=teacher_kl_coef)


@ALGORITHMS.register("rloo")
def rloo(*, n: int = 4, kl_coef: float = 0.05, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
         loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0, temperature: float = DEFAULT_TEMPERATURE,
         top_p: float = 1.0, top_k: int = 0,
         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, rollout_correction: RolloutCorrection | None = None,
         rollout_is_cap: float = DEFAULT_IS_CAP, teacher_kl_coef: float = 0.0,
         reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """RLOO: each sample's baseline is the mean reward of the other samples of its prompt."""
    correction = _correction(rollout_correction, rollout_is_cap)
    g, actor = _rollout("rloo", n=n, reference=True, temperature=temperature, max_new_tokens=max_new_tokens,
                        reward_kind=reward_kind, sampling={**_top(top_p, top_k), **correction.sampling})
    _kl_rewards(g, kl_coef)
    g.compute("advantages", fn="rloo_advantages", inputs=("token_rewards", "loss_mask", "uid"),
              outputs=(advantages_field(teacher_kl_coef),))
    add_teacher_kl(g, teacher_kl_coef)
    g.update(actor, loss="ppo_policy", inputs=(*TRAINED, "old_logprobs", *correction.inputs, "advantages"),
             **_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef), **correction.options)
    return _build(g, kl_coef)


@ALGORITHMS.register("remax")
def remax(*, kl_coef: float = 0.05, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
          loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0, temperature: float = DEFAULT_TEMPERATURE,
          top_p: float = 1.0, top_k: int = 0,
          max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, rollout_correction: RolloutCorrection | None = None,
          rollout_is_cap: float = DEFAULT_IS_CAP, teacher_kl_coef: float = 0.0,
          reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """ReMax: a greedy rollout's reward is the baseline of the sampled one."""
    g = GraphBuilder("remax")
    actor, ref, reward = _policy_roles(g, reward_kind)
    greedy = ("greedy_responses", "greedy_response_mask")  # the score's inputs; the loss mask is not used
    correction = _correction(rollout_correction, rollout_is_cap)
    g.generate(actor, temperature=temperature, max_new_tokens=max_new_tokens, loss_mask=True, **_top(top_p, top_k),
               **correction.sampling)
    g.generate(actor, name="greedy_generate", outputs=(*greedy, "greedy_loss_mask"), greedy=True,
               max_new_tokens=max_new_tokens, loss_mask=True)
    g.score(reward)
    g.score(reward, name="greedy_score", inputs=("prompts", *greedy, "ground_truth"), outputs=("greedy_scores",))
    g.ref_logprob(ref)
    g.logprob(actor)
    _kl_rewards(g, kl_coef)
    g.compute("advantages", fn="remax_advantages", inputs=("token_rewards", "greedy_scores", "loss_mask"),
              outputs=(advantages_field(teacher_kl_coef),))
    add_teacher_kl(g, teacher_kl_coef)
    g.update(actor, loss="ppo_policy", inputs=(*TRAINED, "old_logprobs", *correction.inputs, "advantages"),
             **_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef), **correction.options)
    return _build(g, kl_coef)


def _reinforce_pp(name: str, n: int, kl_coef: float, gamma: float, temperature: float, max_new_tokens: int,
                  reward_kind: RoleKind | str, options: Options, top_p: float = 1.0, top_k: int = 0,
                  correction: _Correction | None = None, teacher_kl_coef: float = 0.0) -> Graph:
    correction = correction or _Correction()
    g, actor = _rollout(name, n=n, reference=True, temperature=temperature, max_new_tokens=max_new_tokens,
                        reward_kind=reward_kind, sampling={**_top(top_p, top_k), **correction.sampling})
    _kl_rewards(g, kl_coef)
    advantages = advantages_field(teacher_kl_coef)
    if n > 1:
        g.compute("advantages", fn="reinforce_pp_baseline_advantages",
                  inputs=("token_rewards", "loss_mask", "uid"), outputs=(advantages,))
    else:
        g.compute("advantages", fn="reinforce_pp_advantages", inputs=("token_rewards", "loss_mask"),
                  outputs=(advantages,), gamma=gamma)
    add_teacher_kl(g, teacher_kl_coef)
    g.update(actor, loss="ppo_policy", inputs=(*TRAINED, "old_logprobs", *correction.inputs, "advantages"), **options,
             **correction.options)
    return _build(g, kl_coef)


@ALGORITHMS.register("reinforce_pp")
def reinforce_pp(*, kl_coef: float = 0.05, gamma: float = 1.0, clip_ratio: float = 0.2,
                 clip_ratio_high: float | None = None, loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0,
                 temperature: float = DEFAULT_TEMPERATURE, top_p: float = 1.0, top_k: int = 0,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
                 teacher_kl_coef: float = 0.0, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """REINFORCE++: KL-penalised discounted returns, whitened over the batch; one sample per prompt."""
    return _reinforce_pp("reinforce_pp", 1, kl_coef, gamma, temperature, max_new_tokens, reward_kind,
                         _actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef), top_p, top_k,
                         _correction(rollout_correction, rollout_is_cap), teacher_kl_coef)


@ALGORITHMS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(*, n: int = 4, kl_coef: float = 0.05, clip_ratio: float = 0.2,
                          clip_ratio_high: float | None = None, loss_agg: LossAgg = "token-mean",
                          entropy_coef: float = 0.0, temperature: float = DEFAULT_TEMPERATURE,
                          top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                          rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
                          teacher_kl_coef: float = 0.0, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """REINFORCE++ with a group-mean baseline over ``n`` samples per prompt, then batch whitening."""
    return _reinforce_pp("reinforce_pp_baseline", n, kl_coef, 1.0, temperature, max_new_tokens, reward_kind,
                         _actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef), top_p, top_k,
                         _correction(rollout_correction, rollout_is_cap), teacher_kl_coef)
