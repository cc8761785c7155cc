"""Rows to environment records (verl extras, GroundTruth context) and per-row environment choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.agents.environments import GuessNumberEnvironment
from hybridflow.agents.records import env_record, environment_for, environment_name
from hybridflow.data.records import GroundTruth, reward_target
from hybridflow.registry import RegistryError

CHAT = [{"role": "user", "content": "Guess my number."}]
TOOLS_KWARGS = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}


def verl_row(**extra_info: object) -> GroundTruth:
    """The ground truth a rollout worker gets for a verl-style row (what the data loader builds)."""
    truth = reward_target({"prompt": CHAT, "ground_truth": "72", "data_source": "openai/gsm8k",
                           "extra_info": {"split": "train", "index": 5, **extra_info}})
    assert isinstance(truth, GroundTruth)
    return truth


def test_verl_extras_map_onto_the_record() -> None:
    record = env_record(3, verl_row(tools_kwargs=TOOLS_KWARGS, interaction_kwargs={"name": "guess_number"}))
    assert record.index == 3 and record.ground_truth == "72" and record.prompt == CHAT
    assert record.tools_kwargs == TOOLS_KWARGS
    assert record.interaction_kwargs == {"name": "guess_number"}
    assert record.extra_info["split"] == "train"
    assert record.ground_truth.columns["data_source"] == "openai/gsm8k"  # type: ignore[attr-defined]


def test_an_explicit_prompt_wins_and_top_level_columns_are_a_fallback() -> None:
    truth = GroundTruth("72", extra_info={}, columns={"tools_kwargs": TOOLS_KWARGS}, prompt=CHAT)
    record = env_record(0, truth, prompt="rendered prompt")
    assert record.prompt == "rendered prompt" and record.tools_kwargs == TOOLS_KWARGS
    assert record.interaction_kwargs == {}


def test_a_plain_string_gives_empty_extras() -> None:
    record = env_record(1, "72")
    assert (record.prompt, record.ground_truth, record.extra_info, record.tools_kwargs) == ("", "72", {}, {})
    assert type(record.ground_truth) is str


def test_malformed_extras_name_the_field_and_row() -> None:
    with pytest.raises(TypeError, match="row 8: tools_kwargs is a str"):
        env_record(8, verl_row(tools_kwargs="calc"))


def test_rows_choose_their_environment_by_interaction_name_or_environment_column(tmp_path: Path) -> None:
    user_env = tmp_path / "my_env.py"
    user_env.write_text("class Fixed:\n    def __init__(self, **options):\n        self.options = options\n")
    default = f"{user_env}:Fixed"
    plain = env_record(0, verl_row())
    assert type(environment_for(plain, default, {"a": 1})).__name__ == "Fixed"
    assert environment_for(plain, default, {"a": 1}).options == {"a": 1}  # type: ignore[attr-defined]

    by_verl = env_record(1, verl_row(interaction_kwargs={"name": "guess_number"}))
    env = environment_for(by_verl, default, {"a": 1}, options_by_name={"guess_number": {"max_attempts": 9}})
    assert isinstance(env, GuessNumberEnvironment) and env.max_attempts == 9

    by_trl = env_record(2, GroundTruth("5", columns={"environment": "guess_number"}))
    assert environment_name(by_trl, default) == "guess_number"


def test_an_unknown_row_environment_lists_the_valid_names(tmp_path: Path) -> None:
    record = env_record(6, verl_row(interaction_kwargs={"name": "gsm8k_interaction"}))
    with pytest.raises(RegistryError, match=r"row 6 asks for environment 'gsm8k_interaction'.*'guess_number'"):
        environment_for(record, "guess_number")
    # A row may name a registered environment, never a file to import.
    spec = env_record(7, verl_row(interaction_kwargs={"name": f"{tmp_path}/evil.py:Env"}))
    with pytest.raises(RegistryError, match="valid names"):
        environment_for(spec, "guess_number")
