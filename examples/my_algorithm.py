"""GRPO with a critic baseline: n samples per prompt and the KL in the loss, as in GRPO, but each
token's baseline is a learned value (Monte-Carlo returns: GAE with lambda = 1) instead of the group mean.

    hybridflow graph examples/my_algorithm.py:critic_grpo --format mermaid
"""

from hybridflow.graph import Graph, GraphBuilder, RoleKind

SEQ = ("prompts", "responses", "response_mask")


def critic_grpo(*, n: int = 4, kl_coef: float = 0.04) -> Graph:
    g = GraphBuilder("critic_grpo")
    actor, critic = g.role("actor", RoleKind.POLICY), g.role("critic", RoleKind.VALUE)
    ref, reward = g.role("reference", RoleKind.FROZEN_POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, n=n)
    g.score(reward)
    g.ref_logprob(ref)
    g.values(critic)
    g.logprob(actor)
    g.compute("token_rewards", fn="token_rewards", inputs=("scores", "response_mask"), outputs=("token_rewards",))
    g.compute("advantages", fn="gae", inputs=("token_rewards", "values", "response_mask"),
              outputs=("advantages", "returns"), gamma=1.0, lam=1.0)
    g.update(critic, loss="value", inputs=(*SEQ, "values", "returns"))
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "old_logprobs", "ref_logprobs", "advantages"),
             kl_coef=kl_coef, kl_type="low_var_kl")
    return g.build()
