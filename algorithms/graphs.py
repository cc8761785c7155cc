"""The built-in algorithms, each a short graph. Maths lives in :mod:`hybridflow.algorithms.core`.

Every factory takes keyword options and returns a validated :class:`~hybridflow.graph.Graph`.
``reward_kind`` chooses a reward model (a network to place on GPUs) or a reward function (a rule).
This module imports no torch, so listing or planning algorithms stays fast.
"""

from __future__ import annotations

from hybridflow.graph import Graph, GraphBuilder, RoleKind
from hybridflow.registry import ALGORITHMS

SEQ = ("prompts", "responses", "response_mask")


def _policy_roles(g: GraphBuilder, reward_kind: RoleKind | str) -> tuple[str, str, str]:
    return (g.role("actor", RoleKind.POLICY), g.role("reference", RoleKind.FROZEN_POLICY),
            g.role("reward", reward_kind))


def _kl_rewards(g: GraphBuilder, kl_coef: float, scores: str = "scores") -> None:
    g.compute("kl_rewards", fn="kl_penalized_rewards", inputs=(scores, "old_logprobs", "ref_logprobs", "response_mask"),
              outputs=("token_rewards",), kl_coef=kl_coef)


@ALGORITHMS.register("ppo")
def ppo(*, kl_coef: float = 0.05, gamma: float = 1.0, lam: float = 0.95, clip_ratio: float = 0.2,
        value_clip: float = 0.2, temperature: float = 1.0, max_new_tokens: int = 32,
        reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """PPO with a critic and GAE; KL to the reference enters the token rewards."""
    g = GraphBuilder("ppo")
    actor, ref, reward = _policy_roles(g, reward_kind)
    critic = g.role("critic", RoleKind.VALUE)
    g.generate(actor, temperature=temperature, max_new_tokens=max_new_tokens)
    g.score(reward)
    g.ref_logprob(ref)
    g.values(critic)
    g.logprob(actor)
    _kl_rewards(g, kl_coef)
    g.compute("gae", fn="gae", inputs=("token_rewards", "values", "response_mask"),
              outputs=("advantages", "returns"), gamma=gamma, lam=lam)
    g.update(critic, loss="value", inputs=(*SEQ, "values", "returns"), clip_range=value_clip)
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "old_logprobs", "advantages"), clip_ratio=clip_ratio)
    return g.build()


@ALGORITHMS.register("grpo")
def grpo(*, n: int = 4, kl_coef: float = 0.04, clip_ratio: float = 0.2, norm_by_std: bool = True,
         temperature: float = 1.0, max_new_tokens: int = 32,
         reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """GRPO: group-normalised outcome advantages, KL to the reference as a loss term, no critic."""
    g = GraphBuilder("grpo")
    actor, ref, reward = _policy_roles(g, reward_kind)
    g.generate(actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    g.score(reward)
    g.ref_logprob(ref)
    g.logprob(actor)
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "response_mask"), outputs=("advantages",),
              group_size=n, norm_by_std=norm_by_std)
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "old_logprobs", "ref_logprobs", "advantages"),
             clip_ratio=clip_ratio, kl_coef=kl_coef, kl_type="low_var_kl")
    return g.build()


@ALGORITHMS.register("rloo")
def rloo(*, n: int = 4, kl_coef: float = 0.05, clip_ratio: float = 0.2, temperature: float = 1.0,
         max_new_tokens: int = 32, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """RLOO: each sample's baseline is the mean reward of the other samples of its prompt."""
    g = GraphBuilder("rloo")
    actor, ref, reward = _policy_roles(g, reward_kind)
    g.generate(actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    g.score(reward)
    g.ref_logprob(ref)
    g.logprob(actor)
    _kl_rewards(g, kl_coef)
    g.compute("advantages", fn="rloo_advantages", inputs=("token_rewards", "response_mask"),
              outputs=("advantages",), group_size=n)
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "old_logprobs", "advantages"), clip_ratio=clip_ratio)
    return g.build()


@ALGORITHMS.register("remax")
def remax(*, kl_coef: float = 0.05, clip_ratio: float = 0.2, temperature: float = 1.0, max_new_tokens: int = 32,
          reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """ReMax: a greedy rollout's reward is the baseline of the sampled one."""
    g = GraphBuilder("remax")
    actor, ref, reward = _policy_roles(g, reward_kind)
    greedy = ("greedy_responses", "greedy_response_mask")
    g.generate(actor, temperature=temperature, max_new_tokens=max_new_tokens)
    g.generate(actor, name="greedy_generate", outputs=greedy, greedy=True, max_new_tokens=max_new_tokens)
    g.score(reward)
    g.score(reward, name="greedy_score", inputs=("prompts", *greedy, "ground_truth"), outputs=("greedy_scores",))
    g.ref_logprob(ref)
    g.logprob(actor)
    _kl_rewards(g, kl_coef)
    g.compute("advantages", fn="remax_advantages", inputs=("token_rewards", "greedy_scores", "response_mask"),
              outputs=("advantages",))
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "old_logprobs", "advantages"), clip_ratio=clip_ratio)
    return g.build()


def _reinforce_pp(name: str, n: int, kl_coef: float, clip_ratio: float, temperature: float, max_new_tokens: int,
                  reward_kind: RoleKind | str, gamma: float) -> Graph:
    g = GraphBuilder(name)
    actor, ref, reward = _policy_roles(g, reward_kind)
    g.generate(actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens)
    g.score(reward)
    g.ref_logprob(ref)
    g.logprob(actor)
    _kl_rewards(g, kl_coef)
    if n > 1:
        g.compute("advantages", fn="reinforce_pp_baseline_advantages", inputs=("token_rewards", "response_mask"),
                  outputs=("advantages",), group_size=n)
    else:
        g.compute("advantages", fn="reinforce_pp_advantages", inputs=("token_rewards", "response_mask"),
                  outputs=("advantages",), gamma=gamma)
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "old_logprobs", "advantages"), clip_ratio=clip_ratio)
    return g.build()


@ALGORITHMS.register("reinforce_pp")
def reinforce_pp(*, kl_coef: float = 0.05, gamma: float = 1.0, clip_ratio: float = 0.2, temperature: float = 1.0,
                 max_new_tokens: int = 32, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """REINFORCE++: KL-penalised discounted returns, whitened over the batch; one sample per prompt."""
    return _reinforce_pp("reinforce_pp", 1, kl_coef, clip_ratio, temperature, max_new_tokens, reward_kind, gamma)


@ALGORITHMS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(*, n: int = 4, kl_coef: float = 0.05, clip_ratio: float = 0.2, temperature: float = 1.0,
                          max_new_tokens: int = 32, reward_kind: RoleKind | str = RoleKind.REWARD_MODEL) -> Graph:
    """REINFORCE++ with a group-mean baseline over ``n`` samples per prompt, then batch whitening."""
    return _reinforce_pp("reinforce_pp_baseline", n, kl_coef, clip_ratio, temperature, max_new_tokens,
                         reward_kind, 1.0)
