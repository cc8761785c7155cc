"""GRPO and PPO visibly raise the reward of an SFT-warmed tiny model on string reversal (fixed seed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.train.config import load_config
from hybridflow.train.loop import train

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMMON = ["progress=false", "tensorboard=false", "plot=false", "checkpoint_every=0", "seed=0",
          "algorithm_options.max_new_tokens=8"]


def _rise(history: list[dict[str, float]], window: int) -> tuple[float, float]:
    rewards = [row["reward/mean"] for row in history]
    return sum(rewards[:window]) / window, sum(rewards[-window:]) / window


@pytest.mark.parametrize(("algorithm", "overrides", "margin"), [
    ("grpo", ["steps=50", "data.batch_size=16", "actor.lr=1e-3", "actor.mini_batches=2"], 0.06),
    ("ppo", ["steps=40", "data.batch_size=32", "actor.lr=5e-4", "critic.lr=3e-3"], 0.05),
])
def test_reward_rises(algorithm: str, overrides: list[str], margin: float, warm_model_dir: Path,
                      tmp_path: Path) -> None:
    config = load_config(CONFIGS / f"{algorithm}_reverse.yaml",
                         [*COMMON, *overrides, f"model.path={warm_model_dir}", f"output_dir={tmp_path}"])
    first, last = _rise(train(config).history, window=6)
    print(f"{algorithm}: mean reward {first:.3f} -> {last:.3f}")
    assert last > first + margin, f"{algorithm}: mean reward {first:.3f} -> {last:.3f}, wanted +{margin}"
