"""GRPO and PPO raise the reward of an SFT-warmed tiny model on string reversal, by margins set from the
measured seed-to-seed spread (benchmarks/learning_spread.py, numbers in docs/benchmarks.md).

Runs are deterministic on one machine (checked below). On another CPU the whole sampled trajectory may
differ (AVX2 vs AVX-512 kernels round differently), which is why each threshold sits at least three
standard deviations of the spread over five seeds below the mean rise, instead of at one lucky run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from learning_configs import LEARNING_RUNS, WINDOW, reward_rise

from hybridflow.train.config import load_config
from hybridflow.train.loop import train

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMMON = ["logging.progress=false", "logging.plot=false", "checkpoint.every=0", "seed=0", "logging.trackers=[jsonl]"]
# Mean rise over seeds 0-4 minus 3 standard deviations, rounded down (docs/benchmarks.md, "Learning spread").
THRESHOLDS = {"grpo": 0.04, "ppo": 0.01}


def _config(algorithm: str, model: Path, out: Path, *extra: str) -> object:
    config_file, overrides = LEARNING_RUNS[algorithm]
    return load_config(CONFIGS / config_file, [*COMMON, *overrides, f"model.path={model}", f"output_dir={out}", *extra])


@pytest.mark.parametrize("algorithm", sorted(THRESHOLDS))
def test_reward_rises(algorithm: str, warm_model_dir: Path, tmp_path: Path) -> None:
    first, last = reward_rise(train(_config(algorithm, warm_model_dir, tmp_path)).history, WINDOW)  # type: ignore[arg-type]
    print(f"{algorithm}: mean reward {first:.3f} -> {last:.3f}")
    assert last > first + THRESHOLDS[algorithm], (f"{algorithm}: mean reward {first:.3f} -> {last:.3f}, wanted "
                                                  f"+{THRESHOLDS[algorithm]}")


def test_a_run_repeats_exactly(warm_model_dir: Path, tmp_path: Path) -> None:
    runs = [train(_config("grpo", warm_model_dir, tmp_path / str(i), "steps=3")).history  # type: ignore[arg-type]
            for i in range(2)]
    timed = ("time/", "timeline/", "throughput/", "memory/")
    strip = [[{k: v for k, v in row.items() if not k.startswith(timed)} for row in run] for run in runs]
    assert strip[0] == strip[1]
