"""The learning tests' runs, shared with benchmarks/learning_spread.py (which measures their seed spread)."""

from __future__ import annotations

WINDOW = 6  # steps averaged at each end of a run

# algorithm -> (config file, overrides); every run starts from the same SFT-warmed model.
LEARNING_RUNS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo_reverse.yaml", ["steps=50", "data.batch_size=16", "optim.actor.lr=1e-3",
                                   "optim.actor.mini_batches=2", "algorithm.options.max_new_tokens=8"]),
    "ppo": ("ppo_reverse.yaml", ["steps=40", "data.batch_size=32", "optim.actor.lr=5e-4", "optim.critic.lr=3e-3",
                                 "algorithm.options.max_new_tokens=8"]),
}
# The same budget for the other group-relative algorithms (learning curves in docs/benchmarks.md, not tests).
_GROUP = ["steps=50", "data.batch_size=16", "optim.actor.lr=1e-3", "optim.actor.mini_batches=2",
          "algorithm.options={n: 8, max_new_tokens: 8}"]
CURVE_RUNS: dict[str, tuple[str, list[str]]] = {
    **LEARNING_RUNS,
    **{name: ("grpo_reverse.yaml", [f"algorithm={name}", *_GROUP]) for name in ("dapo", "dr_grpo", "gspo")},
}


def reward_rise(history: list[dict[str, float]], window: int) -> tuple[float, float]:
    """Mean reward of the first and of the last ``window`` steps."""
    rewards = [row["reward/mean"] for row in history]
    return sum(rewards[:window]) / window, sum(rewards[-window:]) / window
