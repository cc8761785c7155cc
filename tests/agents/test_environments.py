"""The built-in environments: guess_number's feedback that a bisecting policy can use and rewards that could be
wrong; simulated_tools' waits, the same for a row and turn in every instance."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.agents import Environment, EnvRecord
from hybridflow.agents.environments import NO_NUMBER, GuessNumberEnvironment, SimulatedToolsEnvironment
from hybridflow.registry import ENVIRONMENTS


def record(target: int | str, index: int = 0) -> EnvRecord:
    return EnvRecord(index=index, prompt="Guess my number between 1 and 100.", ground_truth=str(target))


def bisect(env: Environment, low: int, high: int) -> tuple[int, float, bool]:
    """Plays the game by bisection, reading only the environment's feedback; returns (turns, reward, done)."""
    turns = 0
    while True:
        guess = (low + high) // 2
        step = env.step(f"Between {low} and {high}, so my guess is {guess}")
        turns += 1
        if step.done:
            return turns, step.reward, True
        feedback = step.observation[0]["content"]
        if feedback == "higher":
            low = guess + 1
        elif feedback == "lower":
            high = guess - 1
        else:
            raise AssertionError(f"unexpected feedback {feedback!r}")


def test_bisection_finds_every_number_within_seven_turns_and_is_rewarded() -> None:
    for target in range(1, 101):
        env = ENVIRONMENTS.get("guess_number")(max_attempts=7)
        assert isinstance(env, Environment)
        assert env.reset(record(target)) == []
        turns, reward, done = bisect(env, 1, 100)
        assert done and reward == 1.0 and turns <= 7, (target, turns, reward)


def test_default_six_attempts_let_perfect_play_win_63_of_100() -> None:
    wins = 0
    for target in range(1, 101):
        env = GuessNumberEnvironment()
        env.reset(record(target))
        wins += bisect(env, 1, 100)[1] == 1.0
    assert wins == 63


def test_wrong_guesses_end_with_zero_after_max_attempts() -> None:
    env = GuessNumberEnvironment(max_attempts=3)
    env.reset(record(70))
    first, second = env.step("50"), env.step("I say 90")
    assert [first.observation, second.observation] == [[{"role": "user", "content": "higher"}],
                                                         [{"role": "user", "content": "lower"}]]
    assert not first.done and not second.done and first.reward == second.reward == 0.0
    last = env.step("80")
    assert last.done and last.reward == 0.0 and last.observation == [] and last.info["attempts"] == 3
    with pytest.raises(RuntimeError, match="after the trajectory ended"):
        env.step("70")


def test_the_last_integer_is_the_guess_and_no_integer_costs_an_attempt() -> None:
    env = GuessNumberEnvironment(max_attempts=3)
    env.reset(record(42))
    missing = env.step("hmm, let me think")
    assert missing.observation == [{"role": "user", "content": NO_NUMBER}] and not missing.done
    found = env.step("not 10, not 99, but 42")
    assert found.done and found.reward == 1.0 and found.info == {"attempts": 2, "guess": 42}


def test_reward_decay_scores_fewer_attempts_higher() -> None:
    env = GuessNumberEnvironment(reward_decay=0.5)
    env.reset(record(3))
    env.step("50")
    env.step("25")
    assert env.step("3").reward == pytest.approx(0.25)


def test_bad_rows_and_options_are_refused_with_what_is_wrong() -> None:
    env = GuessNumberEnvironment()
    with pytest.raises(ValueError, match="row 4 has ground_truth='seven'"):
        env.reset(record("seven", index=4))
    with pytest.raises(ValueError, match=r"outside low=1\.\.high=100"):
        env.reset(record(101))
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("5")
    with pytest.raises(ValueError, match="low=9 must be <= high=2"):
        GuessNumberEnvironment(low=9, high=2)
    with pytest.raises(ValueError, match="reward_decay=0"):
        GuessNumberEnvironment(reward_decay=0)


def test_entry_points_register_the_builtins_without_torch_or_optional_frameworks() -> None:
    probe = ("import sys\nfrom hybridflow.registry import ENVIRONMENTS\nnames = ENVIRONMENTS.names()\n"
             "print(names, sorted(m for m in ('torch', 'skyrl_gym', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    names, imported = result.stdout.strip().split("] [")
    assert {"'guess_number'", "'simulated_tools'", "'skyrl'", "'trl'"} <= set(names.strip("[").split(", ")), names
    assert imported == "]", f"importing the agents built-ins imported {imported}"


def test_simulated_tools_wait_a_seeded_draw_after_every_turn_and_end_after_turns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("hybridflow.agents.environments.time.sleep", slept.append)
    env = ENVIRONMENTS.get("simulated_tools")(turns=3, latency="lognormal:median=0.1,sigma=1.0", seed=7,
                                               observation="42")
    env.reset(record("a", index=5))
    steps = [env.step("turn") for _ in range(3)]
    assert [step.done for step in steps] == [False, False, True]
    assert [step.observation for step in steps[:2]] == [[{"role": "user", "content": "42"}]] * 2
    assert steps[2].observation == []
    assert [step.tool_results[0].seconds for step in steps] == slept and len(set(slept)) == 3
    again = SimulatedToolsEnvironment(turns=3, latency="lognormal:median=0.1,sigma=1.0", seed=7)
    again.reset(record("a", index=5))
    assert [again.delay(turn) for turn in (1, 2, 3)] == slept  # another instance (schedule, process) waits alike
    again.reset(record("a", index=6))
    assert again.delay(1) != slept[0]
    again.reset(record("b", index=5))
    assert again.delay(1) != slept[0]  # the ground truth varies the draws of a repeated batch


def test_simulated_tools_draws_follow_the_distribution() -> None:
    env = SimulatedToolsEnvironment(latency="lognormal:median=0.1,sigma=1.0")
    draws = []
    for index in range(4000):
        env.reset(record("x", index=index))
        draws.append(env.delay(1))
    assert statistics.median(draws) == pytest.approx(0.1, rel=0.1)
    assert statistics.mean(draws) == pytest.approx(0.1 * math.exp(0.5), rel=0.15)  # a lognormal's mean: median·e^{σ²/2}
    fixed = SimulatedToolsEnvironment(latency="fixed:0.25")
    fixed.reset(record("x"))
    assert fixed.delay(1) == fixed.delay(2) == 0.25
    with pytest.raises(ValueError, match="turns=0 must be a positive integer"):
        SimulatedToolsEnvironment(turns=0)
    with pytest.raises(ValueError, match="simulated_tools latency='weibull:2': unknown kind"):
        SimulatedToolsEnvironment(latency="weibull:2")
    with pytest.raises(RuntimeError, match="before reset"):
        SimulatedToolsEnvironment().delay(1)
