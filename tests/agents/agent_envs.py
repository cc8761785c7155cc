"""Environments for the agent tests, loaded by path (``agent_envs.py:Feedback``) as a user's would be."""

from __future__ import annotations

from hybridflow.agents.protocols import EnvRecord, EnvStep


class Feedback:
    """Answers every turn with a user message until ``turns`` turns; rewards the turns that held a digit."""

    def __init__(self, turns: int = 3, message: str = "try again") -> None:
        self.turns, self.message, self.seen = turns, message, 0

    def reset(self, record: EnvRecord) -> list[dict]:
        self.seen = 0
        return []

    def step(self, turn: str) -> EnvStep:
        self.seen += 1
        reward = 0.1 * any(ch.isdigit() for ch in turn)
        if self.seen >= self.turns:
            return EnvStep(done=True, reward=reward)
        return EnvStep(observation=[{"role": "user", "content": self.message}], reward=reward)

    def close(self) -> None:
        return None
