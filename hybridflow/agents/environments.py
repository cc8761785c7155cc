"""Built-in multi-turn environments: worlds whose answers depend on what the model said before.

:class:`GuessNumberEnvironment` (``environment="guess_number"``) is the smallest task that needs feedback across
turns: the row's ground truth is a hidden integer, the model guesses, the environment says ``higher`` or
``lower``. A policy that bisects wins; one that ignores the feedback rarely does. Pure Python and deterministic.
"""

from __future__ import annotations

import re

from hybridflow.agents.protocols import EnvRecord, EnvStep, Message
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
