"""Every config in configs/ and every script in examples/ runs, as a user starts it, for a step or two.

A config or example added without an entry here fails :func:`test_every_shipped_file_is_run_by_a_test`, so
nothing shipped goes untried. The runs are shortened by overrides (steps, SFT warm-up, data size) and keep
everything else of the file: its algorithm, executor, placement, backends and rollout engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["steps=2", "model.sft_steps=2", "logging.progress=false", "logging.plot=false"]

# Config -> the extra overrides its short run needs, or the test that runs it where it needs a launcher.
CONFIGS: dict[str, list[str] | str] = {
    "agent_calculator": ["data.num_examples=32"],
    "dapo_reverse": ["data.num_examples=64"],
    "grpo_detached_vllm": ["data.num_examples=64"],
    "grpo_gsm8k_style": [],
    "grpo_judge": ["data.num_examples=64"],
    "grpo_reverse": ["data.num_examples=64"],
    "grpo_reverse_strong": ["data.num_examples=64"],
    "ppo_reverse": ["data.num_examples=64"],
    "grpo_vision": "tests/train/test_vision_train.py::test_grpo_trains_a_vlm_policy_on_image_prompts",
    "ppo_torchrun": "tests/torchrun/test_torchrun.py::"
                    "test_torchrun_trains_ppo_with_the_actor_data_parallel_over_two_processes",
}
SLOW_CONFIGS = {"grpo_detached_vllm"}  # a Ray cluster and a vLLM engine start

EXAMPLES: dict[str, str] = {
    "classic_tutorial.py": "test_the_classic_tutorial_plans_fits_and_saves",
    "heterogeneous.py": "test_the_heterogeneous_example_rehearses_its_plan",
    "llm_judge.py": "tests/algorithms/test_judge.py",
    "my_algorithm.py": "tests/algorithms/test_builtin_graphs_run.py and tests/test_cli_graph.py",
    "train_ppo.py": "tests/torchrun/test_torchrun.py",
    "data": "tests/data/test_example_dataset.py (the script that writes configs/data/gsm8k_style)",
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_every_shipped_file_is_run_by_a_test() -> None:
    assert sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")) == sorted(CONFIGS)
    assert sorted(p.name for p in (ROOT / "examples").iterdir() if p.name != "__pycache__") == sorted(EXAMPLES)
    for name, where in CONFIGS.items():
        if isinstance(where, str):
            path, _, test = where.partition("::")
            assert f"def {test}(" in (ROOT / path).read_text(), name
            assert f"configs/{name}.yaml" in (ROOT / path).read_text() or name in (ROOT / path).read_text(), name


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.slow, pytest.mark.ray] if name in SLOW_CONFIGS else [])
    for name, extra in CONFIGS.items() if isinstance(extra, list)])
def test_a_shipped_config_trains(name: str, tmp_path: Path) -> None:
    extra = CONFIGS[name]
    assert isinstance(extra, list)
    command = [sys.executable, "-m", "hybridflow.cli", "train", "--config", f"configs/{name}.yaml",
               f"output_dir={tmp_path / name}", *SHORT, *extra]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["reward/mean"] == row["reward/mean"] for row in rows)  # a finite reward every step


@pytest.mark.slow
@pytest.mark.ray
def test_the_classic_tutorial_plans_fits_and_saves(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "classic_tutorial.py")], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = (tmp_path / "runs" / "classic_tutorial" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 5 and (tmp_path / "runs" / "classic_tutorial_saved" / "saved.json").is_file()


@pytest.mark.slow
def test_the_heterogeneous_example_rehearses_its_plan(tmp_path: Path) -> None:
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); import heterogeneous; "
              f"heterogeneous.main(output_dir={str(tmp_path / 'run')!r}, steps=1)")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran 1 steps following the plan" in done.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert {device for group in plan["groups"] for device in [group.get("device")] if device} >= {"A100-80G", "T4"}
