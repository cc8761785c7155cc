"""The agent loop without a model: token-in/token-out exactness under real chat templates, the two schedules,
budgets, and a slow tool delaying only its own trajectory."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from chat_templates import chat_tokenizer

from hybridflow.agents.chat import ChatRenderer
from hybridflow.agents.loop import AgentSettings, EnvironmentFailure, run_trajectories
from hybridflow.agents.protocols import EnvRecord, EnvStep, TurnRequest, TurnResult
from hybridflow.agents.server import BatchingTurnServer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


class ScriptedModel:
    """Answers turn t of every trajectory with ``turns[t]`` (encoded, then the end-of-turn token)."""

    def __init__(self, renderer: ChatRenderer, turns: Sequence[str], *, prompt_len: int) -> None:
        self.renderer, self.turns, self.prompt_len = renderer, list(turns), prompt_len
        self.seen: list[TurnRequest] = []
        self.lock = threading.Lock()

    def __call__(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        results = []
        for request in requests:
            with self.lock:
                self.seen.append(request)
            # every turn and every observation closes with one end-of-turn token
            ends = sum(1 for token in request.token_ids[self.prompt_len:] if token == self.renderer.turn_end_id)
            turn = (ends + 1) // 2
            ids = [*self.renderer.encode(self.turns[min(turn, len(self.turns) - 1)]), self.renderer.turn_end_id]
            ids = ids[:request.max_tokens]
            results.append(TurnResult(token_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids),
                                      finished=ids[-1] == self.renderer.turn_end_id))
        return results


class CalculatorLike:
    """Answers a tool call with a tool message; a turn without one ends the trajectory."""

    def __init__(self, wait: threading.Event | None = None, slow_row: int = -1, fail_on: int = -1) -> None:
        self.wait, self.slow_row, self.fail_on = wait, slow_row, fail_on
        self.row = -1

    def reset(self, record: EnvRecord) -> list[dict]:
        self.row = record.index
        return []

    def step(self, turn: str) -> EnvStep:
        if self.row == self.fail_on:
            raise RuntimeError("the simulator crashed")
        if "<tool_call>" not in turn:
            return EnvStep(done=True, reward=1.0 if "408" in turn else 0.0)
        if self.row == self.slow_row and self.wait is not None:
            assert self.wait.wait(timeout=20), "the other trajectories did not finish while this tool ran"
        return EnvStep(observation=[{"role": "tool", "name": "calculator", "content": "408"}])

    def close(self) -> None:
        return None


def roll(family: str, turns: Sequence[str], *, rows: int = 3, schedule: str = "trajectory", env_factory=None,
         **settings: int):
    tokenizer, end = chat_tokenizer(family)
    renderer = ChatRenderer(tokenizer, turn_end_id=end)
    prompt = renderer.prompt_ids([{"role": "user", "content": "What is 12*34?"}])
    model = ScriptedModel(renderer, turns, prompt_len=len(prompt))
    records = [EnvRecord(index=i, prompt="What is 12*34?") for i in range(rows)]
    with BatchingTurnServer(model) as server:
        out = run_trajectories(records, [prompt] * rows, server=server, renderer=renderer,
                               make_env=env_factory or (lambda record: CalculatorLike()), environment="calc",
                               settings=AgentSettings(schedule=schedule, **{"max_tokens": 400, "max_turn_tokens": 120,
                                                                            **settings}),
                               seeds=list(range(rows)))
    return out, renderer, prompt, model, server


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_trained_tokens_are_the_sampled_tokens_plus_the_rendered_observations(family: str) -> None:
    (trajectory, *_), renderer, prompt, _, _ = roll(family, [CALL, "The answer is 408."])
    first = [*renderer.encode(CALL), renderer.turn_end_id]
    observation = renderer.observation_ids([{"role": "tool", "name": "calculator", "content": "408"}])
    second = [*renderer.encode("The answer is 408."), renderer.turn_end_id]
    assert trajectory.tokens == first + observation + second  # byte for byte: nothing re-rendered
    assert trajectory.sampled == [True] * len(first) + [False] * len(observation) + [True] * len(second)
    assert trajectory.logprobs == [-0.5] * len(first) + [0.0] * len(observation) + [-0.5] * len(second)
    assert (trajectory.turns, trajectory.env_reward, trajectory.finished) == (2, 1.0, True)
    # The whole conversation rendered by the template is exactly the accumulated tokens.
    conversation = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": CALL},
                    {"role": "tool", "name": "calculator", "content": "408"},
                    {"role": "assistant", "content": "The answer is 408."}]
    rendered = renderer.encode(renderer.render_text(conversation, add_generation_prompt=False))
    assert rendered[:len(prompt) + len(trajectory.tokens)] == prompt + trajectory.tokens


def test_re_rendering_would_drift_where_accumulating_does_not() -> None:
    """Llama-3's template trims message text: a turn sampled with a trailing space re-renders without it."""
    (trajectory, *_), renderer, prompt, _, _ = roll("llama3", [CALL + " ", "408 "])
    sampled = [*renderer.encode(CALL + " "), renderer.turn_end_id]
    assert trajectory.tokens[:len(sampled)] == sampled
    conversation = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": CALL + " "}]
    rendered = renderer.encode(renderer.render_text(conversation, add_generation_prompt=False))
    assert rendered != prompt + sampled  # what a re-rendering trainer would have scored instead


@pytest.mark.parametrize("schedule", ["trajectory", "turn"])
def test_both_schedules_build_the_same_trajectories(schedule: str) -> None:
    out, *_ = roll("qwen2", [CALL, CALL, "408"], rows=4, schedule=schedule)
    reference, *_ = roll("qwen2", [CALL, CALL, "408"], rows=4, schedule="turn")
    assert [t.tokens for t in out] == [t.tokens for t in reference]
    assert all(t.turns == 3 for t in out)


def test_the_turn_schedule_samples_each_turn_of_every_row_as_one_batch() -> None:
    *_, server = roll("qwen2", [CALL, "408"], rows=5, schedule="turn")
    assert server.batches == [5, 5]


def test_the_trajectory_schedule_samples_every_first_turn_as_one_batch() -> None:
    *_, server = roll("qwen2", [CALL, "408"], rows=5, schedule="trajectory")
    assert server.batches[0] == 5 and sum(server.batches) == 10


def test_a_slow_tool_delays_only_its_own_trajectory() -> None:
    others_done = threading.Event()
    finished: list[int] = []

    class Tracked(CalculatorLike):
        def step(self, turn: str) -> EnvStep:
            step = super().step(turn)
            if step.done:
                finished.append(self.row)
                if len(finished) == 3:
                    others_done.set()
            return step

    # Row 0's tool returns only once the three other rows have finished every turn.
    out, *_ = roll("qwen2", [CALL, CALL, "408"], rows=4,
                   env_factory=lambda record: Tracked(wait=others_done, slow_row=0))
    assert finished[:3] == [1, 2, 3] or sorted(finished[:3]) == [1, 2, 3]
    assert finished[-1] == 0 and all(t.turns == 3 for t in out)


def test_max_turns_and_token_budgets_end_trajectories() -> None:
    (capped, *_), *_ = roll("qwen2", [CALL], rows=1, max_turns=2)
    assert capped.turns == 2 and not capped.finished and not capped.truncated
    (cut, *_), *_ = roll("qwen2", [CALL], rows=1, max_turn_tokens=10)
    assert cut.turns == 1 and cut.truncated and len(cut.tokens) == 10  # cut before its end token
    (full, *_), *_ = roll("qwen2", [CALL], rows=1, max_tokens=150)
    assert full.truncated and len(full.tokens) <= 150  # the next observation would not have fit


def test_an_environment_that_raises_names_itself_the_row_and_the_turn() -> None:
    with pytest.raises(EnvironmentFailure, match=r"environment 'calc' raised in step on row 1 \(turn 1\).*crashed"):
        roll("qwen2", [CALL], rows=2, env_factory=lambda record: CalculatorLike(fail_on=1))


def test_an_engine_that_batches_continuously_is_called_from_every_trajectory_thread() -> None:
    from hybridflow.agents.server import BatchingTurnServer, DirectTurnServer, turn_server

    second_turns = threading.Barrier(4, timeout=20)  # passes only if all four second turns are in the engine at once
    calls: list[int] = []
    tokenizer, end = chat_tokenizer("qwen2")
    renderer = ChatRenderer(tokenizer, turn_end_id=end)
    prompt = renderer.prompt_ids([{"role": "user", "content": "What is 12*34?"}])
    scripted = ScriptedModel(renderer, [CALL, "408"], prompt_len=len(prompt))

    class Continuous:
        accepts_concurrent_calls = True

        def __call__(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
            calls.append(len(requests))
            if len(requests[0].token_ids) > len(prompt):
                second_turns.wait()
            return scripted(requests)

    assert isinstance(turn_server(scripted), BatchingTurnServer)
    records = [EnvRecord(index=i, prompt="q") for i in range(4)]
    with turn_server(Continuous()) as server:
        assert isinstance(server, DirectTurnServer)
        out = run_trajectories(records, [prompt] * 4, server=server, renderer=renderer,
                               make_env=lambda record: CalculatorLike(), environment="calc",
                               settings=AgentSettings(max_tokens=400, max_turn_tokens=120), seeds=[0, 1, 2, 3])
    # The first turns go together (nothing precedes them); after that each trajectory sends its own.
    assert all(t.turns == 2 for t in out) and server.batches == calls == [4, 1, 1, 1, 1]


class WrongReturns(CalculatorLike):
    """Returns ``answer`` from step on row 1 (or from reset, with ``in_reset``)."""

    def __init__(self, answer: object, *, in_reset: bool = False) -> None:
        super().__init__()
        self.answer, self.in_reset = answer, in_reset

    def reset(self, record: EnvRecord) -> list[dict]:
        self.row = record.index
        return self.answer if self.in_reset and self.row == 1 else []  # type: ignore[return-value]

    def step(self, turn: str) -> EnvStep:
        return self.answer if self.row == 1 else super().step(turn)  # type: ignore[return-value]


@pytest.mark.parametrize(("answer", "in_reset", "what"), [
    (None, False, r"returned NoneType None from step on row 1 \(turn 1\); step must return an EnvStep"),
    (EnvStep(reward=float("nan")), False, r"returned EnvStep\(.*reward=nan.*\) from step on row 1 \(turn 1\); its "
                                          r"reward must be a finite number"),
    (EnvStep(reward="1.0"), False,  # type: ignore[arg-type]
     r"returned EnvStep.*reward='1.0'.* from step on row 1 \(turn 1\); its reward must be a finite"),
    ("hello", True, r"returned str 'hello' from reset on row 1 \(turn 0\); reset must return a list of messages"),
])
def test_an_environment_that_returns_the_wrong_thing_names_itself_the_row_and_the_turn(
        answer: object, in_reset: bool, what: str) -> None:
    with pytest.raises(EnvironmentFailure, match=r"environment 'calc' " + what):
        roll("qwen2", [CALL], rows=2, env_factory=lambda record: WrongReturns(answer, in_reset=in_reset))
