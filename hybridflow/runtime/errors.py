"""Runtime errors, each naming what failed and where."""

from __future__ import annotations


class RuntimeStepError(RuntimeError):
    """A step of the graph failed; ``node`` names the graph node."""

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class WorkerFailedError(RuntimeStepError):
    """A worker process died, hung (no heartbeat) or missed its deadline while running ``role`` on ``rank``.

    ``where`` names the machine (host, Ray node, pid) when known; ``step`` is the training step that was
    running (the loop sets it with :meth:`at_step`), so ``step - 1`` is the last one that completed.
    """

    def __init__(self, *, role: str, rank: int, group: int, node: str | None = None, cause: str = "",
                 where: str | None = None, step: int | None = None) -> None:
        self.role, self.rank, self.group, self.cause, self.where, self.step = role, rank, group, cause, where, step
        super().__init__(self._message(node), node=node)

    def _message(self, node: str | None) -> str:
        at = f" on {self.where}" if self.where else ""
        during = f" during step {self.step} (last completed step: {self.step - 1})" if self.step is not None else ""
        return (f"worker of role {self.role!r} rank {self.rank} (group {self.group}){at} failed while running node "
                f"{node!r}{during}: {self.cause}; resume from the last checkpoint with --resume")

    def at_step(self, step: int) -> WorkerFailedError:
        """Record the training step that was running (the executor does not know it)."""
        self.step = step
        self.args = (self._message(self.node),)
        return self

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only __init__: pickle (Ray, torchrun) needs the fields
        return (_rebuild_worker_failed, (self.role, self.rank, self.group, self.node, self.cause, self.where,
                                         self.step))


def _rebuild_worker_failed(role: str, rank: int, group: int, node: str | None, cause: str, where: str | None,
                           step: int | None) -> WorkerFailedError:
    return WorkerFailedError(role=role, rank=rank, group=group, node=node, cause=cause, where=where, step=step)


class NonFiniteLossError(RuntimeStepError):
    """The loss was NaN or infinite: the step is aborted before any optimizer step or checkpoint."""


class RewardFunctionError(RuntimeStepError):
    """A reward function raised; ``sample`` is the offending row, ``step`` the training step (when known)."""

    def __init__(self, message: str, *, sample: int, node: str | None = None) -> None:
        super().__init__(message, node=node)
        self.sample = sample
        self.step: int | None = None

    def at_step(self, step: int) -> RewardFunctionError:
        """Name the training step that was scoring (the scorer does not know it)."""
        if self.step is None:
            self.step = step
            self.args = (f"{self.args[0]} (during step {step})", *self.args[1:])
        return self

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only __init__: pickle needs the fields
        return (_rebuild_reward_error, (type(self), str(self.args[0]), self.sample, self.node))


class RewardTimeoutError(RewardFunctionError):
    """A reward function call ran past ``data.reward_timeout_s``; the process running it was killed."""


def _rebuild_reward_error(kind: type[RewardFunctionError], message: str, sample: int,
                          node: str | None) -> RewardFunctionError:
    return kind(message, sample=sample, node=node)


class NodeTimeoutError(RuntimeStepError):
    """A node that sets its own deadline (``Node.deadline_s``: an LLM judge's ``judge_timeout_s``) gave no answer
    within it. The step fails before any update that reads its outputs; ``key`` is the setting to raise."""

    def __init__(self, *, node: str, role: str | None, key: str, deadline_s: float, step: int | None = None) -> None:
        self.role, self.key, self.deadline_s, self.step = role, key, deadline_s, step
        super().__init__(self._message(node), node=node)

    def _message(self, node: str | None) -> str:
        of = f" of role {self.role!r}" if self.role else ""
        during = f" during step {self.step} (last completed step: {self.step - 1})" if self.step is not None else ""
        return (f"node {node!r}{of} gave no answer within {self.deadline_s:g} s ({self.key}){during}: raise the "
                f"{self.key}; the last checkpoint is as it was, resume from it with --resume")

    def at_step(self, step: int) -> NodeTimeoutError:
        """Record the training step that was running (the scheduler does not know it)."""
        self.step = step
        self.args = (self._message(self.node),)
        return self

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only __init__: pickle needs the fields
        return (_rebuild_node_timeout, (self.node, self.role, self.key, self.deadline_s, self.step))


def _rebuild_node_timeout(node: str, role: str | None, key: str, deadline_s: float,
                          step: int | None) -> NodeTimeoutError:
    return NodeTimeoutError(node=node, role=role, key=key, deadline_s=deadline_s, step=step)


class StepTracker:
    """A block that names the training step it was running in a :class:`WorkerFailedError`,
    :class:`RewardFunctionError` or :class:`NodeTimeoutError` leaving it.

    The executors do not know steps; the loop sets ``tracker.step`` as each one begins.
    """

    def __init__(self) -> None:
        self.step: int | None = None

    def __enter__(self) -> StepTracker:
        return self

    def __exit__(self, kind: object, err: BaseException | None, trace: object) -> None:
        if isinstance(err, WorkerFailedError | RewardFunctionError | NodeTimeoutError) and err.step is None \
                and self.step is not None:
            err.at_step(self.step)
