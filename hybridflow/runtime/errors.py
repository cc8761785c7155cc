"""Runtime errors, each naming what failed and where."""

from __future__ import annotations


class RuntimeStepError(RuntimeError):
    """A step of the graph failed; ``node`` names the graph node."""

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class WorkerFailedError(RuntimeStepError):
    """A worker process died (or became unreachable) while running ``role`` on ``rank``."""

    def __init__(self, *, role: str, rank: int, group: int, node: str | None = None, cause: str = "") -> None:
        super().__init__(f"worker of role {role!r} rank {rank} (group {group}) failed while running node "
                         f"{node!r}: {cause}; resume from the last checkpoint with --resume", node=node)
        self.role, self.rank, self.group = role, rank, group


class NonFiniteLossError(RuntimeStepError):
    """The loss was NaN or infinite: the step is aborted before any optimizer step or checkpoint."""


class RewardFunctionError(RuntimeStepError):
    """A reward function raised; ``sample`` is the offending row."""

    def __init__(self, message: str, *, sample: int, node: str | None = None) -> None:
        super().__init__(message, node=node)
        self.sample = sample
