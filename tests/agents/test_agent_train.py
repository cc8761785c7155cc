"""Agents from a train config and the classic API: the calculator task trains multi-turn, metrics and validation
tables describe the trajectories, prompts list the tools, and modes that cannot resume a trajectory are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow import DataParallelConfig, SingleController
from hybridflow.data import TASKS
from hybridflow.graph import load_graph
from hybridflow.graph.agents import with_environment, with_schedule
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.modes import check_pipeline
from hybridflow.train.config import config_from_dotted
from hybridflow.train.loop import train
from hybridflow.train.setup import agent_tool_schemas, build_graph

AGENT = {"data.task": "multiply", "data.batch_size": 4, "data.num_examples": 32, "model.sft_steps": 2,
         "algorithm": "grpo_no_ref", "algorithm.options.n": 2, "algorithm.options.max_new_tokens": 32,
         "agent.environment": "calculator", "agent.options": {"format": "compact"}, "agent.max_turns": 2,
         "agent.max_turn_tokens": 12, "logging.progress": False, "logging.plot": False}


def test_a_train_config_runs_the_calculator_task_multi_turn(tmp_path: Path) -> None:
    config = config_from_dotted({**AGENT, "steps": 2, "output_dir": str(tmp_path), "validation.every": 2,
                                 "validation.samples": 2, "data.val_fraction": 0.25})
    train(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "agent/turns_mean" in row]
    assert len(trained) == 2
    for key in ("agent/turns_max", "agent/tool_call_rate", "agent/tool_errors", "agent/tool_timeouts",
                "agent/truncated_fraction", "agent/env_reward_mean", "tokens/trained_fraction"):
        assert key in trained[0], key
    samples = [json.loads(line) for line in (tmp_path / "validation_samples.jsonl").read_text().splitlines()]
    assert {"turns", "tools", "transcript"} <= set(samples[0]["trajectory"])


def test_the_multi_turn_graph_scores_the_policys_own_tokens_and_adds_env_rewards() -> None:
    graph = build_graph(config_from_dotted(AGENT))
    generate = graph.node("actor_generate")
    assert generate.environment == "calculator" and generate.option("agent_schedule") is None  # the plan's call
    assert graph.node("reward_score").inputs[2] == "loss_mask"
    assert graph.node("env_reward_sum").inputs == ("outcome_scores", "env_rewards")
    assert with_schedule(graph, "turn").node("actor_generate").option("agent_schedule") == "turn"
    assert with_schedule(graph, None).node("actor_generate").option("agent_schedule") == "trajectory"


def test_prompts_list_the_environments_tools() -> None:
    schemas = agent_tool_schemas(config_from_dotted(AGENT))
    assert schemas is not None and [s["function"]["name"] for s in schemas] == ["calculator"]
    assert agent_tool_schemas(config_from_dotted({**AGENT, "agent.tools_in_prompt": False})) is None


def test_the_multiply_task_scores_the_last_number_the_policy_wrote() -> None:
    reward = TASKS.get("multiply").reward
    assert reward("@calculator(123*45)5535", "5535") == 1.0
    assert reward("5534", "5535") < 1.0 and reward("", "5535") == 0.0


def test_partial_rollouts_of_a_multi_turn_node_are_its_turns_and_need_the_tokenizer() -> None:
    from hybridflow.runtime.rollouter import Rollouter

    graph = with_environment(load_graph("grpo_no_ref", reward_kind="reward_function"), "calculator")
    mode = ExecutionMode(pipeline="async", max_staleness=1, segment_tokens=0)
    check_pipeline(mode, graph, detached=True)  # runnable: the trajectories run on the driver, turn by turn
    with pytest.raises(ValueError, match="need the policy's tokenizer"):
        Rollouter(graph.node("actor_generate"), None, mode=mode, seed=0, eos_token_id=2)  # type: ignore[arg-type]


def test_an_unknown_environment_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match=r"valid names: .*calculator"):
        agent_tool_schemas(config_from_dotted({**AGENT, "agent.environment": "calculater"}))


def test_the_classic_api_reaches_agents_through_its_settings(tmp_path: Path) -> None:
    controller = SingleController(config=DataParallelConfig(actor_model_device_mesh=[0]), actor_model="tiny-qwen2",
                                  settings={**AGENT, "steps": 1, "output_dir": str(tmp_path)})
    assert controller.graph().node("actor_generate").environment == "calculator"
    controller.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "agent/turns_mean" in rows[0]


def test_a_users_tool_by_path_runs_in_the_tools_environment() -> None:
    from hybridflow.agents import EnvRecord
    from hybridflow.registry import ENVIRONMENTS

    tool = f"{Path(__file__).with_name('user_tools.py')}:word_length"
    env = ENVIRONMENTS.get("tools")(tools=[tool, "calculator"])
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["word_length", "calculator"]
    env.reset(EnvRecord(index=0, prompt="q"))
    step = env.step('<tool_call>\n{"name": "word_length", "arguments": {"word": "agents"}}\n</tool_call>')
    assert not step.done and step.observation[0]["content"] == "6"
    assert env.step("It has 6 letters.").done
