"""On-policy distillation as a built-in graph: the student samples, a teacher scores each sampled token.

The student (``actor``) generates; the ``teacher`` role (a frozen policy, its model ``roles.teacher.model``,
sharing the student's tokenizer) takes the log-probs of the sampled tokens; the advantage of token ``t`` is
``log π_T(y_t) - log π_old(y_t)``, minus the sampled reverse KL (:func:`~hybridflow.algorithms.core.
teacher_kl_advantages`), and the update is the clipped policy gradient (``ppo_policy``) on it. ``reward_coef``
> 0 also scores the responses and adds that coefficient times GRPO's group-relative advantages. The same teacher
term on any policy-gradient graph is that graph's ``teacher_kl_coef`` (:mod:`hybridflow.algorithms.teacher`).
Imports no torch.
"""

from __future__ import annotations

from hybridflow.algorithms.graphs import DEFAULT_IS_CAP, TRAINED, Options, _actor_options, _correction, _sample, _top
from hybridflow.algorithms.modes import LossAgg, RolloutCorrection
from hybridflow.algorithms.teacher import TASK_ADVANTAGES, teacher_logprobs

from hybridflow.graph import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, Graph, GraphBuilder, RoleKind
from hybridflow.registry import ALGORITHMS


def _check_reward_coef(reward_coef: float, n: int) -> None:
    if not reward_coef >= 0:
        raise ValueError(f"algorithm option reward_coef={reward_coef} must be >= 0 (0: pure distillation)")
    if reward_coef and n < 2:
        raise ValueError(f"algorithm option reward_coef={reward_coef} mixes in group-relative reward advantages, "
                         f"which need n >= 2 samples per prompt; n is {n}")


@ALGORITHMS.register("on_policy_distill")
def on_policy_distill(*, n: int = 4, reward_coef: float = 0.0, clip_ratio: float = 0.2,
                      clip_ratio_high: float | None = None, loss_agg: LossAgg = "token-mean",
                      entropy_coef: float = 0.0, temperature: float = DEFAULT_TEMPERATURE, top_p: float = 1.0,
                      top_k: int = 0, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                      rollout_correction: RolloutCorrection | None = None, rollout_is_cap: float = DEFAULT_IS_CAP,
                      mask_truncated: bool = False, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """On-policy distillation into ``actor`` from ``teacher`` by per-token reverse KL (see the module).

    Without ``reward_coef`` the graph has no reward role: nothing is scored, the teacher alone is the signal."""
    _check_reward_coef(reward_coef, n)
    correction = _correction(rollout_correction, rollout_is_cap)
    g = GraphBuilder("on_policy_distill")
    actor = g.role("actor", RoleKind.POLICY)
    reward = g.role("reward", reward_kind) if reward_coef else None
    _sample(g, actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens, mask_truncated=mask_truncated,
            **_top(top_p, top_k), **correction.sampling)
    inputs: tuple[str, ...] = (teacher_logprobs(g), "old_logprobs", "loss_mask")
    g.logprob(actor)
    mix: Options = {}
    if reward is not None:
        g.score(reward)
        g.compute("task_advantages", fn="grpo_advantages", inputs=("scores", "loss_mask", "uid"),
                  outputs=(TASK_ADVANTAGES,))
        inputs, mix = (*inputs, TASK_ADVANTAGES), {"advantages_coef": reward_coef}
    g.compute("advantages", fn="teacher_kl_advantages", inputs=inputs, outputs=("advantages",), **mix)
    g.update(actor, loss="ppo_policy", inputs=(*TRAINED, "old_logprobs", *correction.inputs, "advantages"),
             **_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef), **correction.options)
    return g.build(prune_unread=True)
