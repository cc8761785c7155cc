"""Built-in multi-turn environments: worlds whose answers depend on what the model said before.

:class:`GuessNumberEnvironment` (``environment="guess_number"``) is the smallest task that needs feedback across
turns: the row's ground truth is a hidden integer, the model guesses, the environment says ``higher`` or
``lower``. A policy that bisects wins; one that ignores the feedback rarely does. Pure Python and deterministic.

:class:`SimulatedToolsEnvironment` (``environment="simulated_tools"``) stands in for slow tools when the question is
time, not answers: every turn waits a latency drawn from a distribution (the planner's text form, e.g.
``lognormal:median=0.1,sigma=1.0``), seeded by the row and the turn, so every schedule sees the same waits.
"""

from __future__ import annotations

import random
import re
import time

from hybridflow.agents.protocols import EnvRecord, EnvStep, Message, ToolCall, ToolResult
from hybridflow.planner.distributions import parse_distribution
from hybridflow.registry import ENVIRONMENTS

_INTEGER = re.compile(r"-?\d+")
NO_NUMBER = "no number found, answer with an integer"


@ENVIRONMENTS.register("guess_number")
class GuessNumberEnvironment:
    """Guess the row's hidden integer (its ``ground_truth``) in at most ``max_attempts`` turns.

    Each turn the last integer in the model's text is its guess; the answer is a user message ``"higher"``,
    ``"lower"`` or, with no integer, :data:`NO_NUMBER` (which still uses up an attempt, so a trajectory always
    ends). The right guess ends the trajectory with reward ``reward_decay ** (attempts - 1)`` (1.0 on every
    attempt with the default ``reward_decay=1.0``); running out of attempts ends it with reward 0.

    Bisection finds any number in ``[low, high]`` within ``ceil(log2(high - low + 1))`` guesses: 7 for the
    default 1..100, one more than the default ``max_attempts=6``, so perfect play wins 63 of 100 rows unless
    ``max_attempts`` is raised.
    """

    def __init__(self, *, low: int = 1, high: int = 100, max_attempts: int = 6, reward_decay: float = 1.0) -> None:
        if low > high:
            raise ValueError(f"guess_number: low={low} must be <= high={high}")
        if max_attempts < 1:
            raise ValueError(f"guess_number: max_attempts={max_attempts} must be >= 1")
        if not 0.0 < reward_decay <= 1.0:
            raise ValueError(f"guess_number: reward_decay={reward_decay} must be in (0, 1]")
        self.low, self.high, self.max_attempts, self.reward_decay = low, high, max_attempts, reward_decay
        self.target: int | None = None
        self.attempts = 0
        self.done = False

    def reset(self, record: EnvRecord) -> list[Message]:
        """Hide ``int(record.ground_truth)``; the prompt already explains the game, so nothing is shown."""
        try:
            target = int(str(record.ground_truth).strip())
        except ValueError as err:
            raise ValueError(f"guess_number: row {record.index} has ground_truth={str(record.ground_truth)!r}; "
                             "it must be the hidden integer") from err
        if not self.low <= target <= self.high:
            raise ValueError(f"guess_number: row {record.index} hides {target}, outside low={self.low}.."
                             f"high={self.high}")
        self.target, self.attempts, self.done = target, 0, False
        return []

    def step(self, turn: str) -> EnvStep:
        if self.target is None:
            raise RuntimeError("guess_number: step() before reset()")
        if self.done:
            raise RuntimeError(f"guess_number: step() after the trajectory ended ({self.attempts} attempts)")
        self.attempts += 1
        numbers = _INTEGER.findall(turn)
        guess = int(numbers[-1]) if numbers else None
        info = {"attempts": self.attempts, "guess": guess}
        if guess == self.target:
            self.done = True
            return EnvStep(reward=self.reward_decay ** (self.attempts - 1), done=True, info=info)
        if self.attempts >= self.max_attempts:
            self.done = True
            return EnvStep(reward=0.0, done=True, info=info)
        feedback = NO_NUMBER if guess is None else "higher" if guess < self.target else "lower"
        return EnvStep(observation=[{"role": "user", "content": feedback}], info=info)

    def close(self) -> None:
        self.target = None


SIMULATED_TOOL = "simulated_tool"


@ENVIRONMENTS.register("simulated_tools")
class SimulatedToolsEnvironment:
    """A tool call after every turn that only takes time; the trajectory ends after ``turns`` turns.

    Each turn's call sleeps :meth:`delay` seconds: a draw of ``latency`` (``fixed:0.2``,
    ``lognormal:median=0.1,sigma=1.0``, ``empirical:0.1,0.3,2.0``) by inverse transform of a uniform seeded with
    ``seed``, the row's index and ground truth and the turn, so a row's waits are the same under every schedule
    and in every process. The answer is ``observation`` as a user message (none after the last turn, which
    the call still follows, as a final check would); rewards are 0. The call is recorded as a tool result, so
    the ``agent/tool_latency_*`` metrics see it.
    """

    def __init__(self, *, turns: int = 2, latency: str = "lognormal:median=0.1,sigma=1.0", seed: int = 0,
                 observation: str = "tool output") -> None:
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"simulated_tools: turns={turns!r} must be a positive integer")
        self.turns, self.seed, self.observation = turns, seed, observation
        self.latency = parse_distribution(latency, field="simulated_tools latency")
        self.row: tuple[int, str] | None = None
        self.seen = 0

    def reset(self, record: EnvRecord) -> list[Message]:
        self.row, self.seen = (record.index, str(record.ground_truth)), 0
        return []

    def delay(self, turn: int) -> float:
        """Seconds the call after ``turn`` (1-based) of the current row waits."""
        if self.row is None:
            raise RuntimeError("simulated_tools: delay() before reset()")
        index, truth = self.row
        uniform = random.Random(f"{self.seed}:{index}:{truth}:{turn}").random()  # str seeds hash stably (sha512)
        return float(self.latency.quantile(uniform))

    def step(self, turn: str) -> EnvStep:
        self.seen += 1
        seconds = self.delay(self.seen)
        time.sleep(seconds)
        result = ToolResult(call=ToolCall(name=SIMULATED_TOOL, arguments={}), content=self.observation,
                            seconds=seconds)
        if self.seen >= self.turns:
            return EnvStep(done=True, tool_results=(result,))
        return EnvStep(observation=[{"role": "user", "content": self.observation}], tool_results=(result,))

    def close(self) -> None:
        self.row = None
