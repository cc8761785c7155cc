"""``hybridflow.GRPOTrainer``: TRL's shape (model, reward callables, config object, in-memory dataset), our engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import trl_rewards

from hybridflow import GRPOTrainer
from hybridflow.data.reward_pool import in_a_worker, reward_timeout
from hybridflow.train.config import TrainConfig, load_config
from hybridflow.train.metrics import console_line
from hybridflow.train.trainer import config_mapping, write_rows

WORDS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
ROWS = [{"prompt": [{"role": "user", "content": f"say {w}"}], "task": "math" if i % 2 else "chat",
         "data_source": "math" if i % 2 else "chat"} for i, w in enumerate(WORDS)]


@dataclasses.dataclass
class GRPOConfigLike:
    """The shape of TRL's GRPOConfig: only the fields that differ from their defaults are read."""

    output_dir: str = "trainer_output"
    max_steps: int = 500
    num_generations: int = 8
    max_completion_length: int = 256
    report_to: str = "none"


def test_a_trl_script_trains_on_an_in_memory_dataset(tmp_path: Path) -> None:
    args = GRPOConfigLike(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=2, max_completion_length=4)
    assert config_mapping(args) == {"output_dir": str(tmp_path / "run"), "steps": 2,
                                    "algorithm": {"options": {"n": 2, "max_new_tokens": 4}}}
    options = {**config_mapping(args)["algorithm"]["options"], "mask_truncated": True, "scale_rewards": "batch"}
    trainer = GRPOTrainer("tiny-qwen2", [trl_rewards.short_answers, trl_rewards.only_math],
                          args={**config_mapping(args), "model": {"sft_steps": 0}, "algorithm.options": options,
                                "optim": {"actor": {"lr": 2e-3, "lr_scheduler": "linear", "warmup_steps": 1}},
                                "data": {"batch_size": 4, "val_fraction": 0.25}, "validation": {"before_train": True},
                                "logging": {"trackers": [], "progress": False, "plot": False, "console_every": 1}},
                          train_dataset=ROWS)
    result = trainer.train()
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["actor/lr"] == 0.0 and rows[1]["actor/lr"] == pytest.approx(2e-3)  # one warmup step, then the peak
    assert 0.0 <= rows[0]["reward/short_answers/mean"] <= 1.0 and "reward/only_math/mean" in rows[0]
    assert "val/reward/mean" in rows[0]  # the pass before training, on step 0's line
    assert {"val/math/reward/mean", "val/chat/reward/mean"} & set(rows[0])  # per data source, as verl
    assert rows[0]["actor/kl"] < 1e-4  # before its first update the policy is the reference: the KL starts at 0
    table = [json.loads(line) for line in (result.run_dir / "validation_samples.jsonl").read_text().splitlines()]
    assert table[0]["step"] == -1 and {"prompt", "response", "reward"} <= set(table[0])
    assert (result.run_dir / "final" / "model.safetensors").is_file()


def test_console_lines_and_their_keys() -> None:
    line = console_line(2, 10, {"reward/mean": 0.5, "reward/f/mean": 0.25, "actor/kl": 0.012345, "time/step": 1.5})
    assert line == "step 3/10 | reward/mean 0.5 | reward/f/mean 0.25 | actor/kl 0.01235 | time/step 1.5"
    with pytest.raises(ValueError, match=r"logging\.console_every"):
        load_config(None, ["logging.console_every=-1"])
    with pytest.raises(ValueError, match=r"validation\.before_train.*data\.val_path"):
        load_config(None, ["validation.before_train=true"])


def test_rows_are_written_once_by_content(tmp_path: Path) -> None:
    assert write_rows(ROWS, "train") == write_rows(list(ROWS), "train")
    assert write_rows(ROWS, "train") != write_rows(ROWS[:4], "train")
    with pytest.raises(TypeError, match="row 0 is a str"):
        write_rows(["a"], "train")
    with pytest.raises(ValueError, match="no rows"):
        write_rows([], "eval")


def test_config_objects_go_through_the_same_loader() -> None:
    ours = config_mapping(TrainConfig(steps=3))
    assert ours["steps"] == 3 and ours["optim"]["actor"]["lr"] == TrainConfig().optim.actor.lr
    assert config_mapping({"optim.actor.lr": 1e-4}) == {"optim": {"actor": {"lr": 1e-4}}}
    with pytest.raises(TypeError, match="GRPOTrainer args"):
        config_mapping(3)
    with pytest.raises(ValueError, match="given by the GRPOTrainer's arguments"):
        GRPOTrainer("tiny-qwen2", trl_rewards.short_answers, args={"data": {"path": "x.jsonl"}}, train_dataset=ROWS)


def test_unpicklable_rewards_run_in_process_with_a_warning() -> None:
    assert in_a_worker(trl_rewards.short_answers)
    assert not in_a_worker(lambda prompts, completions, **kw: [0.0] * len(completions))
    assert reward_timeout([trl_rewards.short_answers, "math"], 5.0) == 5.0
    with pytest.warns(UserWarning, match="without a deadline"):
        assert reward_timeout([lambda prompts, completions: [0.0]], 5.0) is None


def test_a_ported_trl_config_keeps_trl_defaults_that_shape_the_update(tmp_path: Path) -> None:
    """Issue 24: TRL trains at 1e-6 decaying linearly to 0 when the GRPOConfig names neither; a ported config does
    the same here (without the decay the ported run's KL to the reference ran ~2x TRL's). A GRPOConfig built on a
    machine without a GPU (use_cpu) is read too, its derived fields compared with a default instance alike."""
    trl = pytest.importorskip("trl")
    mapping = config_mapping(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=8))
    assert mapping["optim"]["actor"] == {"lr": 1e-6, "lr_scheduler": "linear", "grad_clip": 1.0}
    mapping = config_mapping(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, learning_rate=3e-4,
                                            lr_scheduler_type="constant", max_steps=8))
    assert mapping["optim"]["actor"] == {"lr": 3e-4, "lr_scheduler": "constant", "grad_clip": 1.0}
    assert mapping["steps"] == 8
